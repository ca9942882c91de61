"""Conversion between Hugging Face directories and mt checkpoints, and `init_from`.

    mt-train convert hf-to-mt --hf DIR --out DIR [--no-progress]
    mt-train convert mt-to-hf --checkpoint DIR --out DIR [--max-shard-size 5GB]
                              [--dtype bfloat16|float16|float32] [--no-progress]

An mt checkpoint written by ``hf-to-mt`` is a DCP directory like a training checkpoint
but model-only: ``model/<hub key>`` tensors in the source's dtype and a
``train_state.json`` whose ``config`` holds only ``model_family`` and ``model``. The loop
starts from it (or from the Hugging Face directory itself) with ``init_from=DIR``; it is
not a checkpoint to resume (no optimizer or data state). ``mt-to-hf`` accepts either kind
and writes the tensors in their stored dtype (FP32 for a training checkpoint) or, with
``--dtype``, in that dtype, but for what transformers keeps in fp32 (`cast_to_hub_dtype`).
Conversion goes through `mt_models.load_hf` / `save_hf`'s writer, so keys and GPT-OSS's
stacked expert layout are theirs; MXFP4 originals come back dequantized. Both directions
write beside ``--out`` and rename when complete, so a failure leaves no partial ``--out``;
the files are flushed to disk before the rename and the rename after it (a power loss
leaves no ``--out`` with empty files). A conversion holds its ``--out`` until then: a
second one into it is refused. With ``progress``, each phase (reading, writing)
draws a bar on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from mt_data import default_tokenizer_path
from mt_data.manifest import read_manifest
from mt_data.tokenizer import SPECIAL_TOKEN_FILES, load_tokenizer
from mt_models import (
    MODEL_FAMILIES,
    GptOssConfig,
    build_model,
    load_hf,
    load_hf_into,
    save_hf_tensors,
)
from mt_models.configs import TRAINING_ONLY_FIELDS
from mt_models.hf_io import EXPORT_DTYPES, Progress, cast_to_hub_dtype, read_hf_config
from mt_train.checkpoint import (
    FORMAT_VERSION,
    _rename_durably,
    check_format_version,
    checkpoint_root,
    is_checkpoint,
    latest_checkpoint,
    load_model_weights,
    reading_checkpoint,
)
from mt_train.files import lock_or_holder, write_holder

# Files next to the weights that travel with a conversion when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)
_STATE_FILE = "train_state.json"
_OTHER_CHECKPOINT = "give another checkpoint (an earlier step_N of the run, or convert again)"
# ASCII digits only (\d also takes other scripts' digits); ".5" and "5." are numbers too.
_SIZE = re.compile(r"^\s*(\d+\.?\d*|\.\d+)\s*((?:[KMGT]i?)?B)?\s*$", re.IGNORECASE | re.ASCII)
# Tensors read per DCP load call of `read_mt_checkpoint`, when it shows its progress.
_READ_CHUNK_BYTES = 2 * 2**30
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parses a byte size like ``5GB`` (10^9, as Hugging Face counts), ``500MiB`` or ``1000``.

    Args:
        text: a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.

    Returns:
        The size in bytes, computed exactly (no float rounding) and rounded to the nearest
        byte.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(
            f"--max-shard-size ({text!r}) must look like 5GB, 1.5GiB, 500MB or 1000: a "
            "number and one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    unit = (match.group(2) or "B").lower()
    size = round(Fraction(match.group(1)) * _UNITS[unit])
    if size < 1:  # 0 would put every tensor in a shard of its own
        raise ValueError(f"--max-shard-size ({text!r}) must be at least 1 byte, e.g. 5GB")
    return size


def is_hf_dir(path: str | Path) -> bool:
    """True for a Hugging Face directory: config.json and safetensors weights."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def training_tokenizer(checkpoint: str | Path) -> Path | None:
    """The tokenizer.json a checkpoint's model was trained with, when it can be found.

    A tokenizer.json in the checkpoint directory, else the one named by the manifest of
    the run's corpus (``data.path``), else mt-data's default tokenizer for a run on the
    default corpus; None for a model-only checkpoint without one.

    Args:
        checkpoint: an mt checkpoint directory.

    Returns:
        The tokenizer.json path, or None.

    Raises:
        ValueError: the run's corpus is named but its manifest or tokenizer is not there
            (a relative ``data.path`` seen from another directory, a moved corpus): any
            other tokenizer would silently turn the model's ids into other text.
    """
    checkpoint = Path(checkpoint)
    state = _checkpoint_state(checkpoint)
    _model_config_of(checkpoint, state)  # not a checkpoint, or a damaged one: named
    if (checkpoint / "tokenizer.json").is_file():
        return checkpoint / "tokenizer.json"
    data = state.get("config", {}).get("data")
    if data is None:  # model-only: no corpus
        return None
    if not data.get("path"):
        return Path(default_tokenizer_path())
    manifest = Path(data["path"]) / "manifest.json"
    named = (read_manifest(data["path"]) or {}).get("tokenizer")  # bad JSON: named
    if named and Path(named).is_file():
        return Path(named)
    if not manifest.is_file():
        missing = f"{manifest} is not there"
    elif not named:
        missing = f"{manifest} names no tokenizer"
    else:
        missing = f"the tokenizer {named} it names is not there"
    raise ValueError(
        f"checkpoint {checkpoint} was trained on the corpus in {data['path']}, but "
        f"{missing} (seen from {os.getcwd()}); copy the tokenizer.json the model was "
        f"trained with into {checkpoint}"
    )


def training_special_ids(checkpoint: str | Path) -> tuple[int | None, int | None] | None:
    """``(eos_id, bos_id)`` the run's corpus was built with (its manifest's): mt-data stored
    each document as [BOS] + text + EOS, the EOS even where the tokenizer's files name
    another (a corpus built with ``--eos-token``), the BOS only with ``--bos``.

    Args:
        checkpoint: an mt checkpoint directory (complete: `checkpoint_model_config`).

    Returns:
        None for a model-only checkpoint (no corpus: Hugging Face's conventions); else the
        two ids, each None where the manifest records none (the default corpus, whose EOS
        is its tokenizer's, has no BOS).
    """
    state = json.loads((Path(checkpoint) / _STATE_FILE).read_text())
    data = state.get("config", {}).get("data")
    if data is None:
        return None
    facts = read_manifest(data["path"]) if data.get("path") else None
    if facts is None:
        return None, None
    eos_id, bos_id = facts.get("eos_id"), facts.get("bos_id")
    return (eos_id if type(eos_id) is int else None), (bos_id if type(bos_id) is int else None)


def _check_out(out_dir: Path) -> Path:
    """Raises unless `out_dir` is missing or an empty directory other than the current
    one; creates its parent (where the temporary directory goes), before the slow reading
    of the source. Returns it as an absolute path."""
    out_dir = Path(os.path.abspath(out_dir))
    if out_dir == Path.cwd():  # the finished directory is renamed over it
        raise ValueError(
            f"--out {out_dir} is the current directory, which the conversion would replace "
            "by a new one; give a new directory, e.g. --out ./hf"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(
            f"--out {out_dir} exists and is not an empty directory; choose a new directory"
        )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent is a file, no permission, ...
        raise ValueError(
            f"--out {out_dir}: its directory cannot be created ({err}); choose another --out"
        ) from None
    return out_dir


@contextmanager
def _holding_out(out_dir: str | Path) -> Iterator[Path]:
    """Checks `out_dir` (`_check_out`) and holds it for this conversion; yields it absolute.

    The hold is an exclusive `flock` on ``.tmp-<name>.lock`` beside it, which says who
    holds it and is removed at the end: a second conversion into the same ``--out`` (a
    launch script that every node runs, a command started twice) is refused, instead of
    deleting the first one's ``.tmp-<name>``, writing its own files there and renaming a
    mixture into place. Under the hold, a ``.tmp-<name>`` is what a crashed conversion
    left, removed before writing.
    """
    out_dir = _check_out(Path(out_dir))
    path = out_dir.with_name(f".tmp-{out_dir.name}.lock")
    while True:
        try:
            lock = open(path, "a+")  # noqa: SIM115 (held until the conversion ends)
        except OSError as err:  # no permission, a read-only file system, ...
            raise ValueError(
                f"--out {out_dir}: its directory {out_dir.parent} cannot be written ({err}); "
                "choose another --out"
            ) from None
        try:
            holder = lock_or_holder(lock)
        except OSError:  # a filesystem without flock: unguarded
            break
        if holder is not None:
            raise ValueError(
                f"--out {out_dir} is being written by another conversion ({holder}); wait "
                "for it to end, or choose another --out"
            )
        try:  # a conversion that ended removed the file we locked: lock the new one
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        write_holder(lock)
        yield _check_out(out_dir)  # again: another conversion may have filled it meanwhile
    finally:
        path.unlink(missing_ok=True)  # while held: the next conversion opens a new file
        lock.close()


def hf_to_mt(hf_dir: str | Path, out_dir: str | Path, progress: bool = False) -> Path:
    """Writes a model-only mt checkpoint from a Hugging Face directory.

    Args:
        hf_dir: config.json and safetensors (sharded or not).
        out_dir: the checkpoint directory to create; written into ``.tmp-<name>`` beside
            it, renamed when complete and removed if anything fails.
        progress: draw a bar on stderr while reading (per Hub tensor) and writing.

    Returns:
        The checkpoint directory.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not is_hf_dir(hf_dir):
        _refuse_an_mt_checkpoint(hf_dir)
        raise ValueError(
            f"--hf {hf_dir} is not a Hugging Face directory (config.json + *.safetensors)"
        )
    with _holding_out(out_dir) as out_dir:
        with _bar(progress, f"reading {hf_dir}", "tensor") as update:
            model = load_hf(hf_dir, progress=update)
        family = next(n for n, (_, cls) in MODEL_FAMILIES.items() if type(model) is cls)
        tensors = {f"model/{k}": v.detach() for k, v in model.canonical_parameters().items()}
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            with _bar(progress, f"writing {out_dir}", "B") as update, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, checkpoint_id=tmp)  # one call: the bar moves when done
                if update is not None:
                    update(total, total)
            saved = {"model_family": family, "model": _asdict(model.config)}
            config = json.loads(json.dumps(saved))
            state = {
                "format_version": FORMAT_VERSION,
                "step": 0,
                "model_only": True,
                "config": config,
            }
            (tmp / _STATE_FILE).write_text(json.dumps(state, indent=2))
            _copy_tokenizer_files(hf_dir, tmp)
            if out_dir.exists():
                out_dir.rmdir()  # empty, checked above
            _rename_durably(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a whole model's worth of bytes
            raise
        return out_dir


def _refuse_an_mt_checkpoint(path: Path) -> None:
    """Raises a ValueError naming the export when `path`, given where a Hugging Face
    directory is wanted, is an mt checkpoint or a run directory (its newest checkpoint)."""
    newest = next(
        (c for root in (checkpoint_root(path), path) if (c := latest_checkpoint(root))), None
    )
    if is_checkpoint(path):
        what, checkpoint = f"{path} is an mt checkpoint", path
    elif newest is not None:
        what = f"{path} is a run's directory; its newest checkpoint is {newest.path}"
        checkpoint = newest.path
    else:
        return
    raise ValueError(
        f"{what}, not a Hugging Face directory; export it with `mt-train convert mt-to-hf "
        f"--checkpoint {checkpoint} --out DIR`"
    )


@contextmanager
def _bar(enabled: bool, description: str, unit: str) -> Iterator[Progress | None]:
    """A tqdm bar on stderr for one phase of a conversion, as the ``progress(done,
    total)`` callback that mt_models' readers and writers call; None when not enabled."""
    if not enabled:
        yield None
        return
    bar = tqdm(desc=description, unit=unit, unit_scale=unit == "B", file=sys.stderr,
               dynamic_ncols=True)  # fmt: skip

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()


def _asdict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def shell_override(key: str, value: Any) -> str:
    """``key=value`` as a shell word a user can paste: JSON without spaces, quoted when the
    shell would split it or strip its quotes (a list or dict value)."""
    return shlex.quote(f"{key}={json.dumps(value, separators=(',', ':'))}")


def read_mt_checkpoint(
    path: str | Path, progress: Progress | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Reads the model of an mt checkpoint (training or model-only) into CPU tensors.

    Args:
        path: a checkpoint directory (``.metadata`` and ``train_state.json``).
        progress: called as ``progress(done, total)`` in bytes; the tensors are then
            read in groups of about 2 GiB, one DCP load each.

    Returns:
        (model config, Hub key → whole tensor in its stored dtype).
    """
    path = Path(path)
    model_config = checkpoint_model_config(path)
    tensors = {
        f"model/{key}": torch.empty(shape, dtype=dtype)
        for key, (shape, dtype) in checkpoint_model_tensors(path).items()
    }
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    groups: list[list[str]] = [[]]
    for key in tensors:
        if progress is not None and sum(sizes[k] for k in groups[-1]) >= _READ_CHUNK_BYTES:
            groups.append([])
        groups[-1].append(key)
    done = 0
    with warnings.catch_warnings(), reading_checkpoint(path, _OTHER_CHECKPOINT):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for group in groups:
            dcp.load({k: tensors[k] for k in group}, checkpoint_id=path)
            done += sum(sizes[k] for k in group)
            if progress is not None:
                progress(done, sum(sizes.values()))
    return model_config, {k.removeprefix("model/"): v for k, v in tensors.items()}


def checkpoint_model_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Hub key → (shape, dtype) of every model tensor of an mt checkpoint, from its
    ``.metadata`` alone (no tensor read).

    Args:
        path: a checkpoint directory.

    Returns:
        The shapes and stored dtypes.
    """
    with reading_checkpoint(path, _OTHER_CHECKPOINT):
        metadata = dcp.FileSystemReader(path).read_metadata()
    return {
        key.removeprefix("model/"): (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model/")
    }


def _refuse_a_run_dir(path: Path, given: str) -> None:
    """Raises a ValueError naming the newest checkpoint when `path`, given where a
    checkpoint is wanted, is a run directory (or its ``checkpoints/``) holding one."""
    for root in (checkpoint_root(path), path):
        newest = latest_checkpoint(root)
        if newest is not None:
            raise ValueError(
                f"{given}{path} is a run's directory, not a checkpoint: its newest checkpoint "
                f"is {newest.path}; give that (or another step_N directory beside it)"
            )


def checkpoint_model_config(path: Path) -> Any:
    """The model config of a complete mt checkpoint (from its ``train_state.json``),
    without reading its weights.

    Raises:
        ValueError: If `path` is not a complete checkpoint (a run directory is named as
            such, with its newest checkpoint), or its config cannot be built.
    """
    return _model_config_of(path, _checkpoint_state(path))


def _checkpoint_state(path: Path) -> dict[str, Any]:
    """The ``train_state.json`` of a complete mt checkpoint of this format version (read once:
    `checkpoint_model_config` and `training_tokenizer` both need it)."""
    if not (path / ".metadata").is_file() or not (path / _STATE_FILE).is_file():
        _refuse_a_run_dir(path, "")
        if is_hf_dir(path):
            raise ValueError(
                f"{path} is a Hugging Face directory, not an mt checkpoint; make one with "
                f"`mt-train convert hf-to-mt --hf {path} --out DIR`"
            )
        raise ValueError(
            f"{path} is not a complete mt checkpoint (.metadata and {_STATE_FILE}); give a "
            "step_N directory of a run or the output of `mt-train convert hf-to-mt`"
        )
    with reading_checkpoint(path, _OTHER_CHECKPOINT):
        state = json.loads((path / _STATE_FILE).read_text())
    check_format_version(path, state, _OTHER_CHECKPOINT)
    return state


def _model_config_of(path: Path, state: dict[str, Any]) -> Any:
    """The model config saved in checkpoint `path`'s `state` (its ``train_state.json``)."""
    try:
        saved = state["config"]
        return MODEL_FAMILIES[saved["model_family"]][0](**saved["model"])
    except (KeyError, TypeError, ValueError) as err:  # no config, unknown family or fields
        raise ValueError(
            f"checkpoint {path}: {_STATE_FILE} holds no model config this version can build "
            f"({type(err).__name__}: {err}); {_OTHER_CHECKPOINT}"
        ) from None


def mt_to_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    max_shard_size: int = 5 * 10**9,
    progress: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Writes a Hugging Face directory from an mt checkpoint.

    All or nothing: every file is written into ``.tmp-<name>`` beside ``out_dir``, which
    is renamed to ``out_dir`` when complete and removed if anything fails. Host memory is
    the checkpoint's tensors plus about one shard: they are checked against the model
    config's keys and shapes on the meta device (no model is allocated) and written
    directly, each in its stored dtype (as ``hf-to-mt`` read it: a bfloat16 DeepSeek-V2
    saved by transformers keeps its fp32 ``gate.weight``); config.json names the
    embedding's. With ``dtype`` they are cast first, one tensor at a time (peak memory
    grows by one tensor, and falls as fp32 tensors become 16-bit ones).

    Args:
        checkpoint: a training checkpoint (``step_N``) or a model-only one.
        out_dir: the directory to create, or an empty one to fill (config.json, with
            the tokenizer's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``, see
            `_add_special_token_ids`; safetensors, index when sharded, tokenizer
            files found in the checkpoint directory or the training tokenizer, see
            `training_tokenizer`).
        max_shard_size: largest safetensors shard in bytes.
        progress: draw a bar on stderr while reading and writing (per shard).
        dtype: None writes each tensor in its stored dtype (fp32 for a training
            checkpoint's master weights); one of `EXPORT_DTYPES` writes every floating-point
            tensor in it and names it in config.json, except what transformers keeps in
            fp32 in a model of that dtype: in bfloat16 or float16 DeepSeek-V2's router
            ``mlp.gate.weight``, in float16 also GPT-OSS's RMSNorm weights (they are written
            in fp32, as ``save_pretrained`` does).

    Returns:
        The output directory.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(
            f"dtype ({dtype!r}) must be torch.bfloat16, torch.float16 or torch.float32, or "
            "None to write each tensor in its stored dtype"
        )
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    with _holding_out(out_dir) as out_dir:
        tokenizer = training_tokenizer(checkpoint)  # before the slow reading
        with _bar(progress, f"reading {checkpoint}", "B") as update:
            model_config, canonical = read_mt_checkpoint(checkpoint, update)
        family = next(n for n, (cls, _) in MODEL_FAMILIES.items() if isinstance(model_config, cls))
        with torch.device("meta"):
            targets = MODEL_FAMILIES[family][1](model_config).canonical_parameters()
        _check_checkpoint_keys(checkpoint, canonical, targets)
        if dtype is None:
            dtype = canonical["model.embed_tokens.weight"].dtype  # config.json's
        else:
            cast_to_hub_dtype(family, canonical, dtype)
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _bar(progress, f"writing {out_dir}", "B") as update:
                save_hf_tensors(family, model_config, canonical, tmp, max_shard_size, dtype, update)
            _copy_tokenizer_files(checkpoint, tmp)
            if tokenizer is not None and not (tmp / "tokenizer.json").exists():
                shutil.copy2(tokenizer, tmp / "tokenizer.json")
                for name in SPECIAL_TOKEN_FILES:  # where mt-data read its EOS and BOS
                    beside = tokenizer.parent / name
                    if beside.is_file() and not (tmp / name).exists():
                        shutil.copy2(beside, tmp / name)
            _add_special_token_ids(tmp, (training_special_ids(checkpoint) or (None, None))[0])
            if out_dir.exists():
                out_dir.rmdir()  # empty, checked above
            _rename_durably(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir


def _add_special_token_ids(directory: Path, eos_id: int | None = None) -> None:
    """Writes ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` into config.json.

    Without a generation_config.json, transformers' ``generate`` takes these ids from
    config.json (it stops at the EOS and pads batches with the PAD); the family configs
    carry no token ids, so a model trained here would otherwise never stop. The EOS is the
    one mt-data resolves (``eos_token`` of tokenizer_config.json or
    special_tokens_map.json, in transformers' precedence, else its fallback list); BOS and PAD are
    tokenizer_config.json's ``bos_token`` and ``pad_token``, text or an AddedToken dict's
    ``content``. An id config.json already holds (not null) is kept; a
    token the files do not name or the vocabulary lacks is left out. Nothing is written
    when the tokenizer files are missing, unreadable or name no EOS, but a given ``eos_id``.

    Args:
        directory: an exported Hugging Face directory (config.json, tokenizer files).
        eos_id: the EOS the corpus was built with (`training_special_ids`), which wins over the
            tokenizer's; None: the tokenizer's.
    """
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    keep = eos_id is None or config.get("eos_token_id") is not None
    known = {} if keep else {"eos_token_id": eos_id}
    try:
        loaded = load_tokenizer(directory)
    except (FileNotFoundError, ValueError):  # no tokenizer.json, an unreadable one, or no EOS
        if known:
            config_path.write_text(json.dumps(config | known, indent=2, sort_keys=True) + "\n")
        return
    # When present, tokenizer_config.json is a JSON object, else load_tokenizer has raised.
    tokenizer_config = directory / "tokenizer_config.json"
    named = json.loads(tokenizer_config.read_text("utf-8")) if tokenizer_config.is_file() else {}
    texts = {"eos_token_id": loaded.eos_token}
    for key, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
        token = named.get(name)
        texts[key] = token.get("content") if isinstance(token, dict) else token
    ids = {k: loaded.tokenizer.token_to_id(t) for k, t in texts.items() if isinstance(t, str)}
    added = {k: i for k, i in ids.items() if i is not None and config.get(k) is None} | known
    if added:
        config_path.write_text(json.dumps(config | added, indent=2, sort_keys=True) + "\n")


def _check_checkpoint_keys(
    checkpoint: Path, canonical: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
) -> None:
    """Raises unless the checkpoint holds exactly its model config's parameters and shapes.

    Args:
        checkpoint: the checkpoint directory (for error messages).
        canonical: Hub key → tensor read from it.
        targets: the model's ``canonical_parameters()`` (meta tensors: shapes only).
    """
    missing = sorted(set(targets) - set(canonical))
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint} lacks {len(missing)} parameter(s) of its own model "
            f"config, e.g. {missing[:3]}; the checkpoint is damaged or from another version"
        )
    unexpected = sorted(set(canonical) - set(targets))
    if unexpected:
        raise ValueError(
            f"checkpoint {checkpoint} holds {len(unexpected)} parameter(s) its own model "
            f"config does not have, e.g. {unexpected[:3]}; the checkpoint is damaged or "
            "from another version"
        )
    for key, target in targets.items():
        if canonical[key].shape != target.shape:
            raise ValueError(
                f"checkpoint {checkpoint}: {key} has shape {tuple(canonical[key].shape)} but "
                f"its own model config gives {tuple(target.shape)}; the checkpoint is damaged "
                "or from another version"
            )


def _init_source_kind(path: Path) -> str:
    if is_hf_dir(path):
        return "hf"
    if (path / ".metadata").is_file():
        return "mt"
    _refuse_a_run_dir(path, "init_from: ")
    raise ValueError(
        f"init_from ({str(path)!r}) is neither a Hugging Face directory (config.json + "
        "*.safetensors) nor an mt checkpoint (.metadata + train_state.json)"
    )


def read_init_config(path: str | Path) -> Any:
    """The model config of an `init_from` source (a Hugging Face directory or an mt
    checkpoint), without reading its weights."""
    path = Path(path)
    if _init_source_kind(path) == "hf":
        return read_hf_config(path)[1]
    return checkpoint_model_config(path)


def init_from_weights(model: torch.nn.Module, path: str | Path) -> Any:
    """Copies `init_from` weights into the model, sharded or not, streaming.

    Each rank reads only the tensors it holds (its experts, its FSDP2 shards), one Hub
    tensor at a time from a Hugging Face directory, through DCP from an mt checkpoint;
    values are cast to the parameters' dtypes. No rank holds the whole model.

    Args:
        model: the run's model (after parallelization).
        path: a Hugging Face directory or an mt checkpoint.

    Returns:
        The source's model config.
    """
    path = Path(path)
    source = read_init_config(path)
    if type(source) is not type(model.config):
        family = {cls: name for name, (cls, _) in MODEL_FAMILIES.items()}
        raise ValueError(
            f"{path} holds a {family[type(source)]} model but the model is "
            f"{family[type(model.config)]}; choose a model of the checkpoint's family"
        )
    try:
        if _init_source_kind(path) == "hf":
            return load_hf_into(model, path)
        load_model_weights(path, model)
    except ValueError as err:
        differences = init_config_differences(source, model.config)
        if not differences or _tensor_shapes(source) == _tensor_shapes(model.config):
            raise  # the same tensors: a damaged source, whatever else differs
        raise ValueError(
            f"{err}; the run's model config differs from init_from's in "
            + ", ".join(
                f"{k} ({json.dumps(v[0])} there, {json.dumps(v[1])} here)"
                for k, v in differences.items()
            )
            + ": to start from it, override "
            + " ".join(shell_override(f"model.{k}", v[0]) for k, v in differences.items())
        ) from None
    return source


def _tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Canonical key → shape of the model of `config` (built on meta: no memory)."""
    with torch.device("meta"):
        model = build_model(config)
    return {k: tuple(v.shape) for k, v in model.canonical_parameters().items()}


# Model config fields that shape training, not the function the weights compute.
_NOT_ARCHITECTURE = (*TRAINING_ONLY_FIELDS, "router_aux_loss_coef", "initializer_range")


def init_config_differences(source: Any, model_config: Any) -> dict[str, tuple[Any, Any]]:
    """Model config fields where a run differs from its `init_from` source.

    Shapes are checked when the weights are copied; a difference here (``rope_theta``,
    ``rms_norm_eps``, ``norm_topk_prob``, ``rope_scaling``, ...) loads without error but
    computes another function than the source's model.

    Args:
        source: the `init_from` source's model config (from `init_from_weights` or
            `read_init_config`).
        model_config: the run's model config.

    Returns:
        Field → (the source's value, the run's value), JSON-normalized; empty when they
        agree or the source is of another family (its weights then do not load). GPT-OSS's
        ``sliding_window`` and ``layer_types`` differ only where some layer's window does.
    """
    if type(source) is not type(model_config):
        return {}
    theirs, ours = (json.loads(json.dumps(_asdict(c))) for c in (source, model_config))
    differences = {
        key: (theirs[key], ours[key])
        for key in sorted(theirs)
        if key not in _NOT_ARCHITECTURE and theirs[key] != ours[key]
    }
    # save_hf writes a GPT-OSS without a window as every layer "full_attention" with a window
    # (transformers fails on a null one): another config, the same model.
    if isinstance(source, GptOssConfig) and _layer_windows(source) == _layer_windows(model_config):
        differences.pop("sliding_window", None)
        differences.pop("layer_types", None)
    return differences


def tensor_config_differences(source: Any, model_config: Any) -> dict[str, tuple[Any, Any]]:
    """The `init_config_differences` that change the model's tensors: each field whose
    source value alone, put into `model_config`, changes a tensor's key or shape (all of
    them when no single field does, as when two change together).

    Args:
        source: a checkpoint's or `init_from` source's model config.
        model_config: the run's model config.

    Returns:
        Field → (the source's value, the run's value); empty when the tensors agree.
    """
    differences = init_config_differences(source, model_config)
    ours = _tensor_shapes(model_config)
    if not differences or _tensor_shapes(source) == ours:
        return {}
    changing = {}
    for key, values in differences.items():
        try:
            reverted = dataclasses.replace(model_config, **{key: getattr(source, key)})
        except (ValueError, TypeError):  # valid only beside the source's other values
            changing[key] = values
            continue
        if _tensor_shapes(reverted) != ours:
            changing[key] = values
    return changing or differences


def _layer_windows(config: GptOssConfig) -> list[int | None]:
    return [config.window(i) for i in range(config.num_hidden_layers)]
