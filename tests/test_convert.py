"""`mt-train convert` both ways, and a run that starts from a Hugging Face checkpoint."""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mt_data import default_tokenizer_path
from mt_models import build_model, deepseek_v2, gpt_oss, hf_io, qwen3_moe, save_hf
from mt_train import convert
from mt_train.checkpoint import FORMAT_VERSION
from mt_train.cli import main
from mt_train.convert import mt_to_hf, parse_size
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import pretrain, setup

# Tiny configs of the three families (a few hundred kB each).
FAMILIES = {
    "qwen3_moe": dataclasses.replace(
        qwen3_moe.debug(), vocab_size=512, hidden_size=32, num_hidden_layers=2,
        moe_intermediate_size=16, intermediate_size=32,
    ),
    "deepseek_v2": dataclasses.replace(
        deepseek_v2.debug(), vocab_size=512, num_hidden_layers=2
    ),
    "gpt_oss": dataclasses.replace(
        gpt_oss.debug(), vocab_size=512, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def _hf_tensors(path):
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                out[key] = f.get_tensor(key)
    return out


def _write_hf(config, path, dtype, seed=7):
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.to(dtype)
    save_hf(model, path)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')


def _write_bfloat16_deepseek_with_fp32_routers(path):
    """A bfloat16 DeepSeek-V2 as transformers saves one: gate.weight in fp32 (with values no
    bfloat16 holds); returns its tensors."""
    from safetensors.torch import load_file, save_file

    _write_hf(FAMILIES["deepseek_v2"], path, torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    gates = [k for k in tensors if k.endswith("mlp.gate.weight")]
    assert gates
    for key in gates:
        tensors[key] = tensors[key].float() + 1e-4
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_mt_to_hf_reproduces_every_tensor_key_dtype_and_value(tmp_path, family):
    original = tmp_path / "hf"
    _write_hf(FAMILIES[family], original, torch.bfloat16)
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    assert main([
        "convert", "mt-to-hf", "--checkpoint", str(tmp_path / "mt"), "--out",
        str(tmp_path / "back"), "--max-shard-size", "40KB",
    ]) == 0
    before, after = _hf_tensors(original), _hf_tensors(tmp_path / "back")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key], tensor), key
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "40KB shards: more than one file"
    assert (tmp_path / "back" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == json.loads((original / "config.json").read_text())


def test_hf_to_mt_to_hf_keeps_a_bfloat16_deepseek_fp32_router(tmp_path):
    # transformers saves a bfloat16 DeepSeek-V2 with gate.weight in fp32; mt-to-hf cast every
    # tensor to the embedding's dtype, so the round trip rounded the routers to bfloat16.
    original = tmp_path / "hf"
    tensors = _write_bfloat16_deepseek_with_fp32_routers(original)
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    assert main(["convert", "mt-to-hf", "--checkpoint", str(tmp_path / "mt"), "--out",
                 str(tmp_path / "back")]) == 0
    after = _hf_tensors(tmp_path / "back")
    assert sorted(after) == sorted(tensors)
    for key, tensor in tensors.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


# What transformers keeps in fp32 in a model of a lower dtype, and so saves in fp32, by family
# and dtype: `_keep_in_fp32_modules_strict` (bfloat16 and float16: DeepSeek-V2's router) and
# `_keep_in_fp32_modules` (float16 alone: GPT-OSS's RMSNorm weights).
_KEPT_FP32 = {
    ("deepseek_v2", torch.bfloat16): r"^model\.layers\.\d+\.mlp\.gate\.weight$",
    ("deepseek_v2", torch.float16): r"^model\.layers\.\d+\.mlp\.gate\.weight$",
    ("gpt_oss", torch.float16): r"^model\.(norm|layers\.\d+\.(input|post_attention)_layernorm)\.",
}


def _export_fp32_with_dtype(tmp_path, family, dtype):
    """A training-like fp32 checkpoint of `family` exported with ``--dtype``; returns the fp32
    Hub tensors it holds and the export's directory."""
    original = tmp_path / "hf"
    _write_hf(FAMILIES[family], original, torch.float32)
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    name = str(dtype).removeprefix("torch.")
    assert main(["convert", "mt-to-hf", "--checkpoint", str(tmp_path / "mt"), "--out",
                 str(tmp_path / "back"), "--max-shard-size", "40KB", "--dtype", name]) == 0
    return _hf_tensors(original), tmp_path / "back"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mt_to_hf_dtype_writes_every_tensor_in_it_but_what_transformers_keeps_fp32(
    tmp_path, family, dtype
):
    # A training checkpoint holds fp32 master weights, and mt-to-hf wrote them as stored:
    # twice the Hub's size, config.json "float32", and no way to ask for bfloat16.
    fp32, back = _export_fp32_with_dtype(tmp_path, family, dtype)
    after = _hf_tensors(back)
    assert sorted(after) == sorted(fp32)
    kept = {k for k in fp32 if re.match(_KEPT_FP32.get((family, dtype), r"^$"), k)}
    assert bool(kept) == ((family, dtype) in _KEPT_FP32)
    for key, tensor in fp32.items():
        assert tensor.dtype == torch.float32, key
        if key in kept:
            assert after[key].dtype == torch.float32 and torch.equal(after[key], tensor), key
        else:
            assert after[key].dtype == dtype and torch.equal(after[key], tensor.to(dtype)), key
    embed = fp32["model.embed_tokens.weight"]
    assert not torch.equal(embed.to(dtype).float(), embed), "fp32 values the dtype rounds"
    config = json.loads((back / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert original["dtype"] == "float32"
    assert config == original | {"dtype": str(dtype).removeprefix("torch.")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_half_export_of_an_fp32_checkpoint_converts_back_and_loads(tmp_path, family, dtype):
    # In float16, GPT-OSS's norms are exported in fp32: load_hf and generate rounded them.
    from mt_train.generate import load_checkpoint_model

    fp32, back = _export_fp32_with_dtype(tmp_path, family, dtype)
    exported = _hf_tensors(back)
    assert main(["convert", "hf-to-mt", "--hf", str(back), "--out", str(tmp_path / "mt2")]) == 0
    _, again = convert.read_mt_checkpoint(tmp_path / "mt2")
    _, first = convert.read_mt_checkpoint(tmp_path / "mt")
    assert sorted(again) == sorted(first) == sorted(hf_io.hub_to_canonical(family, fp32))
    for key, tensor in hf_io.hub_to_canonical(family, exported).items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for params in (
        hf_io.load_hf(back).canonical_parameters(),
        load_checkpoint_model(tmp_path / "mt2").canonical_parameters(),
    ):
        assert sorted(params) == sorted(again)
        for key, tensor in again.items():
            assert params[key].dtype == tensor.dtype, key
            assert torch.equal(params[key].detach(), tensor), key


def test_mt_to_hf_refuses_a_dtype_it_cannot_write_naming_the_choices(
    tmp_path, mt_checkpoint, capsys
):
    out = tmp_path / "back"
    argv = ["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out", str(out),
            "--dtype", "int8"]  # fmt: skip
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype: invalid choice: 'int8'" in err
    assert "'bfloat16', 'float16', 'float32'" in err
    for dtype in (torch.int8, "bfloat16", torch.float64):
        with pytest.raises(ValueError, match=rf"dtype \({re.escape(repr(dtype))}\) must be "
                           r"torch.bfloat16, torch.float16 or torch.float32"):  # fmt: skip
            mt_to_hf(mt_checkpoint, out, dtype=dtype)
    assert list(tmp_path.iterdir()) == []


def test_mt_to_hf_help_names_the_dtypes_the_default_and_what_stays_fp32(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "mt-to-hf", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--dtype {bfloat16,float16,float32}" in out
    assert "Default: each tensor's stored dtype, float32 for a training checkpoint's" in out
    assert "DeepSeek-V2's router mlp.gate.weight" in out and "GPT-OSS's RMSNorm weights" in out


def test_generate_runs_a_bfloat16_deepseek_with_its_fp32_routers_as_stored(tmp_path):
    # hf-to-mt keeps the fp32 gate.weight transformers saves in a bfloat16 DeepSeek-V2, but
    # generate cast the whole model to the embedding's dtype: the routers were rounded to
    # bfloat16 and routed otherwise than transformers' (and load_hf's) model.
    from mt_train.generate import load_checkpoint_model

    original = tmp_path / "hf"
    tensors = _write_bfloat16_deepseek_with_fp32_routers(original)
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    params = load_checkpoint_model(tmp_path / "mt").canonical_parameters()
    assert sorted(params) == sorted(tensors)
    for key, tensor in tensors.items():
        assert params[key].dtype == tensor.dtype and torch.equal(params[key], tensor), key


@pytest.fixture(scope="module")
def mt_checkpoint(tmp_path_factory):
    """A model-only mt checkpoint of the tiny GPT-OSS config (stacked experts on export);
    tests only read it."""
    root = tmp_path_factory.mktemp("mt_checkpoint")
    _write_hf(FAMILIES["gpt_oss"], root / "hf", torch.bfloat16)
    assert main(["convert", "hf-to-mt", "--hf", str(root / "hf"), "--out", str(root / "mt")]) == 0
    return root / "mt"


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_mt_to_hf_refuses_a_non_empty_out_and_leaves_it_untouched(tmp_path, mt_checkpoint):
    out = tmp_path / "back"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"--out .*back exists and is not an empty directory"):
        mt_to_hf(mt_checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert _siblings(out) == ["back"], "no .tmp-back left behind"


def test_convert_help_says_an_existing_out_is_refused_unless_empty(capsys):
    # --help said only "directory to write": whether an existing --out is replaced, merged
    # into or refused was left to a try.
    for direction in ("hf-to-mt", "mt-to-hf"):
        with pytest.raises(SystemExit):
            main(["convert", direction, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "a new or empty directory; an existing one with files is refused" in out, out


def test_convert_to_an_out_that_is_a_file_is_refused_naming_it(tmp_path, mt_checkpoint):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    with pytest.raises(ValueError, match=r"--out .*notes.txt exists and is not an empty dir"):
        mt_to_hf(mt_checkpoint, out)
    with pytest.raises(ValueError, match=r"--out .*notes.txt exists and is not an empty dir"):
        convert.hf_to_mt(mt_to_hf(mt_checkpoint, tmp_path / "hf"), out)
    assert out.read_text() == "keep me"


def test_mt_to_hf_fills_an_empty_out_and_leaves_no_temporary_directory(tmp_path, mt_checkpoint):
    out = tmp_path / "back"
    out.mkdir()
    assert mt_to_hf(mt_checkpoint, out) == out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"
    ]
    assert _siblings(out) == ["back"]


def test_both_conversions_flush_every_file_and_the_rename(tmp_path, mt_checkpoint, monkeypatch):
    # A power loss after the call returns must find every file whole under --out: each
    # file and directory is fsynced before the rename, and the rename (its parent) after.
    synced = []
    real_fsync = convert.os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(convert.os, "fsync", recording_fsync)
    hf = mt_to_hf(mt_checkpoint, tmp_path / "hf", max_shard_size=40_000)
    hf_synced, synced[:] = list(synced), []
    mt = convert.hf_to_mt(hf, tmp_path / "mt")
    for out, done in ((hf, hf_synced), (mt, synced)):
        tmp = out.with_name(f".tmp-{out.name}")
        for path in [out, *out.rglob("*")]:
            assert tmp / path.relative_to(out) in done, f"{path} was not fsynced"
        assert done[-1] == out.parent, f"{out}: the rename was not fsynced after it"


def test_mt_to_hf_failing_on_the_second_shard_leaves_no_out_and_no_temporary(
    tmp_path, mt_checkpoint, monkeypatch
):
    written = []

    def save_file_failing_second(tensors, filename, metadata=None):
        if written:
            raise OSError("disk full (simulated)")
        real_save_file(tensors, filename, metadata=metadata)
        written.append(filename)

    real_save_file = hf_io.save_file
    monkeypatch.setattr(hf_io, "save_file", save_file_failing_second)
    out = tmp_path / "back"
    with pytest.raises(OSError, match="disk full"):
        mt_to_hf(mt_checkpoint, out, max_shard_size=40_000)
    assert len(written) == 1, "the first shard was written, then the failure"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "the temporary directory is removed"


def test_hf_to_mt_interrupted_after_writing_leaves_no_out_and_no_temporary(tmp_path, monkeypatch):
    _write_hf(FAMILIES["qwen3_moe"], tmp_path / "hf", torch.bfloat16)
    real_save = convert.dcp.save

    def save_then_interrupt(*args, **kwargs):
        real_save(*args, **kwargs)  # the weights are on disk, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(convert.dcp, "save", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert.hf_to_mt(tmp_path / "hf", tmp_path / "mt")
    assert _siblings(tmp_path / "hf") == ["hf"], "no out and no .tmp-mt of a whole model"


@pytest.mark.parametrize("second", ["mt-to-hf", "hf-to-mt"])
def test_a_conversion_into_an_out_another_is_writing_is_refused_and_the_first_completes(
    tmp_path, mt_checkpoint, monkeypatch, second
):
    # Two conversions into one --out at once (a launch script that every node runs): the
    # second took over the first's .tmp-<out> (deleted it, wrote its own files there) and
    # the two renamed a mixture into place, or the first failed on its vanished directory.
    hf = mt_to_hf(mt_checkpoint, tmp_path / "source_hf")
    out = tmp_path / "out"
    real_save = convert.save_hf_tensors
    refused = []

    def save_while_another_starts(*args, **kwargs):
        if not refused:  # the first conversion's save (and only once: no recursion)
            refused.append("not refused")
            with pytest.raises(ValueError) as err:
                if second == "mt-to-hf":
                    mt_to_hf(mt_checkpoint, out)
                else:
                    convert.hf_to_mt(hf, out)
            refused[0] = str(err.value)
        real_save(*args, **kwargs)

    monkeypatch.setattr(convert, "save_hf_tensors", save_while_another_starts)
    assert mt_to_hf(mt_checkpoint, out) == out
    assert len(refused) == 1
    assert f"--out {out} is being written by another conversion (pid {os.getpid()}" in refused[0]
    assert _hf_tensors(out).keys() == _hf_tensors(hf).keys()
    for key, tensor in _hf_tensors(hf).items():
        assert torch.equal(_hf_tensors(out)[key], tensor), key
    assert _siblings(out) == ["out", "source_hf"], "no lock or temporary directory is left"


def test_an_out_whose_directory_cannot_be_written_is_a_one_line_error_before_reading(
    tmp_path, mt_checkpoint, monkeypatch, capsys
):
    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    def no_reading(*args, **kwargs):
        raise AssertionError("the source was read")

    monkeypatch.setattr(convert, "open", read_only, raising=False)  # the lock beside --out
    monkeypatch.setattr(convert, "read_mt_checkpoint", no_reading)
    out = tmp_path / "out"
    argv = ["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"mt-train: error: --out {out}: its directory {tmp_path} cannot be written "
        f"([Errno 13] Permission denied: '{tmp_path / '.tmp-out.lock'}'); choose another --out\n"
    )


def test_mt_to_hf_never_allocates_a_model(tmp_path, mt_checkpoint, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("mt_to_hf materialized a model (to_empty)")

    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)
    out = mt_to_hf(mt_checkpoint, tmp_path / "back", max_shard_size=40_000)
    original = _hf_tensors(mt_checkpoint.parent / "hf")
    exported = _hf_tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())


@pytest.mark.parametrize("damage", ["extra_key", "wrong_shape"])
def test_mt_to_hf_refuses_a_checkpoint_that_does_not_fit_its_config(
    tmp_path, mt_checkpoint, monkeypatch, damage
):
    real_read = convert.read_mt_checkpoint

    def read_damaged(path, progress=None):
        config, tensors = real_read(path, progress)
        if damage == "extra_key":
            tensors["model.layers.9.mlp.gate.weight"] = torch.zeros(4, 32)
        else:
            tensors["model.norm.weight"] = torch.ones(7)
        return config, tensors

    monkeypatch.setattr(convert, "read_mt_checkpoint", read_damaged)
    expected = {
        "extra_key": r"holds 1 parameter\(s\) its own model config does not have, e\.g\. "
        r"\['model\.layers\.9\.mlp\.gate\.weight'\]",
        "wrong_shape": r"model\.norm\.weight has shape \(7,\) but its own model config gives",
    }[damage]
    with pytest.raises(ValueError, match=expected):
        mt_to_hf(mt_checkpoint, tmp_path / "back")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("damage", ["missing_key", "extra_key", "wrong_shape"])
def test_generate_refuses_a_checkpoint_that_does_not_fit_its_config_naming_the_tensor(
    tmp_path, mt_checkpoint, capsys, damage
):
    # generate copied the tensors into the model by key: a KeyError or a copy_ RuntimeError
    # traceback (an extra tensor went unnoticed).
    import torch.distributed.checkpoint as dcp

    _, tensors = convert.read_mt_checkpoint(mt_checkpoint)
    if damage == "missing_key":
        del tensors["model.norm.weight"]
    elif damage == "extra_key":
        tensors["model.layers.9.mlp.gate.weight"] = torch.zeros(4, 32)
    else:
        tensors["model.norm.weight"] = torch.ones(7)
    checkpoint = tmp_path / "damaged"
    dcp.save({f"model/{k}": v for k, v in tensors.items()}, checkpoint_id=checkpoint)
    for name in ("train_state.json", "tokenizer.json"):
        shutil.copy(mt_checkpoint / name, checkpoint / name)
    _write_word_tokenizer(checkpoint, {"eos_token": "</s>"})
    expected = {
        "missing_key": "lacks 1 tensor(s) the model needs, e.g. ['model/model.norm.weight']",
        "extra_key": "holds 1 model tensor(s) this model lacks, e.g. "
        "['model/model.layers.9.mlp.gate.weight']",
        "wrong_shape": "model/model.norm.weight has shape (7,) but the model gives",
    }[damage]
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoint}" in err and expected in err, err
    assert "the checkpoint is damaged or from another version" in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


def _edited_copy(mt_checkpoint, checkpoint, edit):
    """Copies `mt_checkpoint` to `checkpoint` with `edit` applied to its train_state.json
    (in place); returns the edited state."""
    shutil.copytree(mt_checkpoint, checkpoint)
    state = json.loads((checkpoint / "train_state.json").read_text())
    edit(state)
    (checkpoint / "train_state.json").write_text(json.dumps(state))
    return state


def _assert_mt_to_hf_and_generate_refuse(checkpoint, out, capsys, *expected):
    """`convert mt-to-hf` and `generate` of `checkpoint` exit with 2 and a one-line error
    holding every `expected` text, and write no `out`."""
    for argv in (
        ["convert", "mt-to-hf", "--checkpoint", str(checkpoint), "--out", str(out)],
        ["generate", "--checkpoint", str(checkpoint), "--prompt", "x"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert all(text in err for text in expected) and "Traceback" not in err, err
    assert not out.exists()


def test_convert_and_generate_name_a_damaged_checkpoint_in_a_one_line_error(
    tmp_path, mt_checkpoint, capsys
):
    damaged = tmp_path / "damaged"
    shutil.copytree(mt_checkpoint, damaged)
    (data,) = damaged.glob("*.distcp")
    data.unlink()
    (tmp_path / "empty_metadata").mkdir()
    shutil.copytree(mt_checkpoint, tmp_path / "empty_metadata", dirs_exist_ok=True)
    (tmp_path / "empty_metadata" / ".metadata").write_bytes(b"")
    for checkpoint in (damaged, tmp_path / "empty_metadata"):
        # A real tokenizer: generate reads it, a cheap check, before the weights.
        _write_word_tokenizer(checkpoint, {"eos_token": "</s>"})
        _assert_mt_to_hf_and_generate_refuse(
            checkpoint, tmp_path / "back", capsys,
            f"checkpoint {checkpoint} cannot be read, it is damaged", "give another checkpoint",
        )  # fmt: skip


def test_hf_to_mt_and_init_from_name_a_damaged_config_json_index_or_shard(
    tmp_path, mt_checkpoint, capsys
):
    hf = mt_checkpoint.parent / "hf"
    damages = {
        "config.json": (b"{not json", "config.json is not valid JSON"),
        "config.json ": (b"[]", "config.json holds a JSON list, not an object"),
        "model.safetensors": (b"\x10\x00", "model.safetensors is not a readable safetensors"),
    }
    for i, (name, (content, expected)) in enumerate(damages.items()):
        source = tmp_path / f"hf{i}"
        shutil.copytree(hf, source)
        (source / name.strip()).write_bytes(content)
        argv = ["convert", "hf-to-mt", "--hf", str(source), "--out", str(tmp_path / "out")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(source) in err and expected in err and "Traceback" not in err, err
        with pytest.raises(ValueError, match=expected):
            convert.init_from_weights(build_model(FAMILIES["gpt_oss"]), source)
    sharded = tmp_path / "sharded"
    _write_hf(FAMILIES["qwen3_moe"], sharded, torch.float32)
    save_hf(hf_io.load_hf(sharded), sharded, max_shard_size=100_000)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        hf_io.load_hf(sharded)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_model_config_this_version_cannot_build_is_a_one_line_error(
    tmp_path, mt_checkpoint, capsys
):
    edits = {
        "newer": lambda state: state["config"]["model"].update(a_newer_field=1),
        "no_config": lambda state: state.pop("config"),
        "unknown_family": lambda state: state["config"].update(model_family="llama"),
    }
    for name, edit in edits.items():
        checkpoint = tmp_path / name
        _edited_copy(mt_checkpoint, checkpoint, edit)
        _assert_mt_to_hf_and_generate_refuse(
            checkpoint, tmp_path / "back", capsys,
            f"checkpoint {checkpoint}: train_state.json holds no model config",
            "give another checkpoint",
        )  # fmt: skip


def test_a_checkpoint_of_a_newer_format_version_is_refused_by_convert_and_generate(
    tmp_path, mt_checkpoint, capsys
):
    checkpoint = tmp_path / "newer"
    newer = FORMAT_VERSION + 1
    _edited_copy(mt_checkpoint, checkpoint, lambda state: state.update(format_version=newer))
    _assert_mt_to_hf_and_generate_refuse(
        checkpoint, tmp_path / "back", capsys,
        f"checkpoint {checkpoint} has format version {newer}",
        "upgrade moetrain",
    )  # fmt: skip


def test_a_checkpoint_whose_corpus_tokenizer_is_not_found_is_an_error_not_another_tokenizer(
    tmp_path, mt_checkpoint, capsys
):
    checkpoint = tmp_path / "step_00000002"
    # A corpus relative to where the run was started.
    state = _edited_copy(
        mt_checkpoint, checkpoint, lambda state: state["config"].update(data={"path": "corpus"})
    )
    (checkpoint / "tokenizer.json").unlink()
    for argv in (
        ["convert", "mt-to-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "back")],
        ["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--max-new-tokens", "1"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"trained on the corpus in corpus, but {Path('corpus', 'manifest.json')} is not" \
            in err, err
        assert f"copy the tokenizer.json the model was trained with into {checkpoint}" in err
    assert not (tmp_path / "back").exists()
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text("{}")
    state["config"]["data"] = {"path": str(tmp_path / "corpus")}
    (checkpoint / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"corpus/manifest.json names no tokenizer \(seen"):
        convert.training_tokenizer(checkpoint)


@pytest.mark.parametrize("manifest", ["not json", "[1, 2]"])
def test_a_run_corpus_manifest_that_is_no_json_object_is_an_error_naming_it(
    tmp_path, mt_checkpoint, capsys, manifest
):
    # generate said 'Expecting value: line 1 column 1 (char 0)', naming no file, or (a JSON
    # list) raised AttributeError: 'list' object has no attribute 'get'.
    checkpoint = tmp_path / "step_00000002"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(manifest)
    _edited_copy(
        mt_checkpoint, checkpoint, lambda state: state["config"].update(data={"path": str(corpus)})
    )
    shutil.copy(default_tokenizer_path(), checkpoint / "tokenizer.json")
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--max-new-tokens", "1"]
    for tokenizer_in_checkpoint in (True, False):  # the corpus's special ids, its tokenizer
        if not tokenizer_in_checkpoint:
            (checkpoint / "tokenizer.json").unlink()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mt-train: error: {corpus / 'manifest.json'}: "), err
        assert err.count("\n") == 1


def test_generate_puts_the_space_a_metaspace_tokenizer_decodes_between_prompt_and_new_text(
    tmp_path, mt_checkpoint, monkeypatch
):
    # generate returned prompt + decode(new tokens); a sentencepiece-style (Metaspace)
    # decoder drops the space of the first token it decodes, so "Hello" and "▁world"
    # came back as "Helloworld".
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    import mt_train.generate

    vocab = {"▁Hello": 0, "▁world": 1, "▁again": 2, "<|endoftext|>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    checkpoint = tmp_path / "model_only"
    shutil.copytree(mt_checkpoint, checkpoint)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    script = iter([1, 2, 3])  # world, again, EOS

    def model(input_ids):
        logits = torch.zeros(1, input_ids.shape[1], len(vocab))
        logits[0, -1, next(script)] = 1.0
        return logits

    monkeypatch.setattr(mt_train.generate, "load_checkpoint_model", lambda *args: model)
    assert mt_train.generate.generate(checkpoint, "Hello") == "Hello world again"


def test_generate_reads_train_state_json_once_for_each_thing_it_looks_up(
    tmp_path, mt_checkpoint, monkeypatch
):
    # A run's checkpoint, whose tokenizer its corpus's manifest names: train_state.json was
    # read five times, twice by training_tokenizer (the config check, then the corpus),
    # once each for the prompt's vocabulary check and the corpus's special ids, and once
    # more for load_checkpoint_model's config, which generate had read already.
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mt_train.generate import generate

    vocab = {"Hello": 0, "world": 1, "<|endoftext|>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="world"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "corpus").mkdir()
    tokenizer.save(str(tmp_path / "corpus" / "tokenizer.json"))
    manifest = {"tokenizer": str(tmp_path / "corpus" / "tokenizer.json")}
    (tmp_path / "corpus" / "manifest.json").write_text(json.dumps(manifest))
    checkpoint = tmp_path / "step_00000002"
    data = {"path": str(tmp_path / "corpus")}
    _edited_copy(mt_checkpoint, checkpoint, lambda state: state["config"].update(data=data))
    (checkpoint / "tokenizer.json").unlink()
    reads = []
    read_text = Path.read_text

    def counting_read_text(self, *args, **kwargs):
        if self.name == "train_state.json":
            reads.append(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    assert generate(checkpoint, "Hello", max_new_tokens=1).startswith("Hello")
    # The tokenizer's lookup, the model config, the corpus's special ids.
    assert len(reads) == 3, reads


def test_generate_stops_at_every_eos_id_of_the_checkpoint_generation_config_json(
    tmp_path, mt_checkpoint, monkeypatch
):
    # hf-to-mt copies generation_config.json (GPT-OSS's eos_token_id: <|return|>,
    # <|endoftext|> and <|call|>; Qwen3's: <|im_end|> and <|endoftext|>), where transformers'
    # generate stops; generate stopped only at the tokenizer's EOS and ran on past the others.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    import mt_train.generate

    vocab = {"▁Hello": 0, "▁world": 1, "▁again": 2, "<|endoftext|>": 3, "<|call|>": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    checkpoint = tmp_path / "model_only"
    shutil.copytree(mt_checkpoint, checkpoint)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    cases = (([3, 4], "Hello world"), (4, "Hello world"),
             (None, "Hello world<|call|> again again"))  # fmt: skip
    for eos_ids, expected in cases:
        config = {"eos_token_id": eos_ids} if eos_ids is not None else {"do_sample": False}
        (checkpoint / "generation_config.json").write_text(json.dumps(config))
        script = iter([1, 4, 2, 2, 3])  # world, <|call|>, again, again, EOS

        def model(input_ids, script=script):
            logits = torch.zeros(1, input_ids.shape[1], len(vocab))
            logits[0, -1, next(script)] = 1.0
            return logits

        monkeypatch.setattr(mt_train.generate, "load_checkpoint_model", lambda *a, m=model: m)
        assert mt_train.generate.generate(checkpoint, "Hello") == expected, eos_ids


def test_generate_and_mt_to_hf_use_the_eos_id_the_corpus_was_built_with(
    tmp_path, mt_checkpoint, monkeypatch
):
    # A corpus built with --eos-token ends its documents with another token than the one
    # the tokenizer's files name; its manifest records the id. generate stopped at the files'
    # EOS (never at the model's) and mt-to-hf wrote that one as config.json's eos_token_id.
    import mt_train.generate

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_word_tokenizer(corpus, {"eos_token": "</s>"})  # </s> is id 3
    manifest = {"tokenizer": str(corpus / "tokenizer.json"), "eos_id": 4}  # <pad>
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    checkpoint = tmp_path / "step_00000002"
    _edited_copy(mt_checkpoint, checkpoint,
                 lambda state: state["config"].update(data={"path": str(corpus)}))  # fmt: skip
    (checkpoint / "tokenizer.json").unlink()
    script = iter([1, 4, 1, 3])  # hello, <pad> (the corpus EOS), hello, </s>

    def model(input_ids):
        logits = torch.zeros(1, input_ids.shape[1], 5)
        logits[0, -1, next(script)] = 1.0
        return logits

    monkeypatch.setattr(mt_train.generate, "load_checkpoint_model", lambda *args: model)
    assert mt_train.generate.generate(checkpoint, "hello") == "hello hello"
    mt_to_hf(checkpoint, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 4


def test_generate_encodes_a_prompt_as_the_corpus_encoded_documents(
    tmp_path, mt_checkpoint, monkeypatch
):
    # mt-data stores [BOS if built with --bos] + text ids (no post-processor); generate
    # encoded prompts with the tokenizer's post-processor, so a tokenizer.json that adds a
    # BOS (Llama's) put an id the model never saw at position 0, and --bos was ignored.
    # A model-only (Hugging Face) checkpoint keeps Hugging Face's encoding.
    from tokenizers import Tokenizer, processors

    import mt_train.generate

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_word_tokenizer(corpus, {"eos_token": "</s>"})
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    tokenizer.save(str(corpus / "tokenizer.json"))
    model_only = tmp_path / "model_only"
    shutil.copytree(mt_checkpoint, model_only)
    shutil.copy(corpus / "tokenizer.json", model_only / "tokenizer.json")
    shutil.copy(corpus / "tokenizer_config.json", model_only / "tokenizer_config.json")
    seen = []

    def model(input_ids):
        seen.append(input_ids[0].tolist())
        logits = torch.zeros(1, input_ids.shape[1], 5)
        logits[0, -1, 3] = 1.0  # </s>
        return logits

    monkeypatch.setattr(mt_train.generate, "load_checkpoint_model", lambda *args: model)
    for bos_id, expected in ((None, [1]), (4, [4, 1])):
        manifest = {"tokenizer": str(corpus / "tokenizer.json"), "eos_id": 3, "bos_id": bos_id}
        (corpus / "manifest.json").write_text(json.dumps(manifest))
        checkpoint = tmp_path / f"step_{bos_id}"
        _edited_copy(mt_checkpoint, checkpoint,
                     lambda state: state["config"].update(data={"path": str(corpus)}))  # fmt: skip
        (checkpoint / "tokenizer.json").unlink()
        mt_train.generate.generate(checkpoint, "hello", max_new_tokens=1)
        assert seen.pop() == expected, bos_id
    mt_train.generate.generate(model_only, "hello", max_new_tokens=1)
    assert seen.pop() == [2, 1]


def test_mt_to_hf_exports_the_special_tokens_map_json_beside_the_corpus_tokenizer(
    tmp_path, mt_checkpoint
):
    # Only tokenizer_config.json travelled with the corpus's tokenizer.json: an EOS that
    # special_tokens_map.json alone names (mt-data reads it) was lost to the export's
    # tokenizer, and config.json got the fallback list's EOS instead of the corpus's.
    from tokenizers import Tokenizer, models

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    vocab = {"<unk>": 0, "hello": 1, "<|endoftext|>": 2, "</s>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(corpus / "tokenizer.json"))
    (corpus / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    (corpus / "manifest.json").write_text(json.dumps({"tokenizer": str(corpus / "tokenizer.json")}))
    checkpoint = tmp_path / "step_00000002"
    _edited_copy(mt_checkpoint, checkpoint,
                 lambda state: state["config"].update(data={"path": str(corpus)}))  # fmt: skip
    (checkpoint / "tokenizer.json").unlink()
    mt_to_hf(checkpoint, tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "special_tokens_map.json").read_text())
    assert exported == {"eos_token": "</s>"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 3


def test_generate_with_a_tokenizer_larger_than_the_model_names_the_token_before_reading_weights(
    tmp_path, mt_checkpoint, capsys, monkeypatch
):
    checkpoint = tmp_path / "model_only"
    shutil.copytree(mt_checkpoint, checkpoint)
    # mt-data's default: more than 512 tokens
    shutil.copy(default_tokenizer_path(), checkpoint / "tokenizer.json")

    def read_weights(*args):
        raise AssertionError("the config alone tells the prompt does not fit the model")

    monkeypatch.setattr("mt_train.generate.load_checkpoint_model", read_weights)
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "def hello_world():"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is outside the model's vocabulary (vocab_size 512)" in err, err
    assert f"copy the model's tokenizer.json into {checkpoint}" in err


def test_generate_from_a_model_only_checkpoint_without_a_tokenizer_is_an_error_naming_it(
    tmp_path, mt_checkpoint, capsys, monkeypatch
):
    # It fell back to mt-data's default tokenizer: the model's ids decoded as other text
    # whenever its vocabulary was at least as large (every released model's is).
    checkpoint = tmp_path / "model_only"
    shutil.copytree(mt_checkpoint, checkpoint)
    (checkpoint / "tokenizer.json").unlink()

    def read_weights(*args):
        raise AssertionError("the weights were read before the tokenizer was found")

    monkeypatch.setattr("mt_train.generate.load_checkpoint_model", read_weights)
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoint} holds no tokenizer.json" in err, err
    assert f"copy the model's tokenizer.json into {checkpoint}" in err, err


def test_an_out_under_a_file_is_a_one_line_error_naming_it(tmp_path, mt_checkpoint, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    for argv in (
        ["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out", str(out)],
        ["convert", "hf-to-mt", "--hf", str(mt_checkpoint.parent / "hf"), "--out", str(out)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: its directory cannot be created" in err, err
        assert "choose another --out" in err and "Traceback" not in err


def test_a_conversion_failing_to_write_is_a_one_line_error_exiting_1_leaving_nothing(
    tmp_path, mt_checkpoint, monkeypatch, capsys
):
    # A full disk (or a read-only or pseudo file system, e.g. --out /proc/hf) while writing:
    # a runtime failure, not a usage error; the traceback said nothing more than this line.
    def save_file_full(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device")

    def dcp_save_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_io, "save_file", save_file_full)
    monkeypatch.setattr(convert.dcp, "save", dcp_save_full)
    out = tmp_path / "out"
    for argv in (
        ["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out", str(out)],
        ["convert", "hf-to-mt", "--hf", str(mt_checkpoint.parent / "hf"), "--out", str(out)],
    ):
        assert main([*argv, "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("mt-train: error: OSError: [Errno 28] No space left on device"), err
        assert f"--out {out} was not written (nothing is left there)" in err
        assert f"converting {argv[2]} {argv[3]} failed" in err  # the source, named as given
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_the_current_directory_is_refused_naming_it(
    tmp_path, mt_checkpoint, monkeypatch, capsys
):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for out in (".", ""):  # "" is the current directory too
        assert main(["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"--out {tmp_path / 'here'} is the current directory" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "here"]
    assert list((tmp_path / "here").iterdir()) == []


def test_parse_size_reads_decimal_and_binary_units():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size("five gigs")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.01GB", 2_010_000_000),  # float arithmetic gave 2_009_999_999
        ("4.1GB", 4_100_000_000),
        ("1.5GiB", 3 * 2**29),
        ("0.5KiB", 512),
        ("123456789123456789", 123456789123456789),  # past float's 53 bits
        ("0.3KiB", 307),  # 307.2 bytes: the nearest byte
        ("1.9", 2),
        (".5GB", 500_000_000),
        (" 7 mib ", 7 * 2**20),
    ],
)
def test_parse_size_is_exact_and_rounds_to_the_nearest_byte(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["5iB", "5GiBB", "\uff15GB", "1.2.3GB", "5 G B", "", "nan", "1e9"])
def test_parse_size_refuses_what_is_not_a_size_naming_it(text):
    shown = re.escape(repr(text))
    with pytest.raises(ValueError, match=rf"--max-shard-size \({shown}\) must look like 5GB"):
        parse_size(text)


def test_a_max_shard_size_below_one_byte_is_refused_not_one_tensor_per_shard(
    tmp_path, mt_checkpoint, capsys
):
    for text in ("0", "0GB", "0.4", "-5", "5 GBs"):
        with pytest.raises(ValueError, match=rf"--max-shard-size \({re.escape(repr(text))}\)"):
            parse_size(text)
    argv = ["convert", "mt-to-hf", "--checkpoint", str(mt_checkpoint), "--out",
            str(tmp_path / "back"), "--max-shard-size", "0"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size ('0') must be at least 1 byte" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=r"max_shard_size \(0\) must be a number of bytes >= 1"):
        mt_to_hf(mt_checkpoint, tmp_path / "back", max_shard_size=0)
    assert not (tmp_path / "back").exists()
    with pytest.raises(SystemExit):
        main(["convert", "mt-to-hf", "--help"])
    assert "largest safetensors shard in bytes" in " ".join(capsys.readouterr().out.split())




@pytest.mark.parametrize("source", ["hf", "mt"])
def test_a_run_starts_from_imported_weights_with_a_fresh_optimizer(tmp_path, source):
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32, seed=123)
    if source == "mt":
        assert main(["convert", "hf-to-mt", "--hf", str(tmp_path / "hf"),
                     "--out", str(tmp_path / "mt")]) == 0
    overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / source}"]
    state = setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    hf = _hf_tensors(tmp_path / "hf")
    params = state.model.canonical_parameters()
    assert sorted(params) == sorted(hf)
    for key, param in params.items():
        assert torch.equal(param.detach(), hf[key]), key
    for moments in state.optimizer.state.values():  # a fresh AdamW: zero moments, step 0
        assert all(not torch.any(t) for t in moments.values())
    assert state.step == 0


def test_init_from_a_mismatched_model_names_the_parameter_and_shapes(tmp_path):
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32)
    overrides = ["model.hidden_size=32", f"run_dir={tmp_path / 'run'}",
                 f"init_from={tmp_path / 'hf'}"]
    with pytest.raises(ValueError, match=r"has shape .* but the model has"):
        pretrain(resolve_config(get_recipe("tiny"), overrides=overrides))


@pytest.mark.parametrize("source", ["hf", "mt"])
def test_init_from_a_mismatched_model_names_the_config_fields_that_differ_and_the_fix(
    tmp_path, source
):
    # The errors named a tensor and its shapes (or a list of missing experts), never the
    # recipe's model fields that made them differ from the source's.
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32)
    if source == "mt":
        argv = ["convert", "hf-to-mt", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mt")]
        assert main(argv) == 0
    for field, value in (("hidden_size", 32), ("num_experts", 4),
                         ("tie_word_embeddings", True)):  # fmt: skip
        overrides = [f"model.{field}={json.dumps(value)}", f"run_dir={tmp_path / field}",
                     f"init_from={tmp_path / source}"]  # fmt: skip
        with pytest.raises(ValueError) as err:
            setup(resolve_config(get_recipe("tiny"), overrides=overrides))
        theirs = getattr(cfg.model, field)
        differs = f"differs from init_from's in {field} ({json.dumps(theirs)} there, "
        assert differs + f"{json.dumps(value)} here)" in str(err.value), err.value
        assert f"override model.{field}={json.dumps(theirs)}" in str(err.value), err.value


def test_init_from_a_damaged_source_is_not_blamed_on_a_config_field_that_changes_no_tensor(
    tmp_path,
):
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32)
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00")
    overrides = [f"model.rope_theta={2 * cfg.model.rope_theta}", f"run_dir={tmp_path / 'run'}",
                 f"init_from={tmp_path / 'hf'}"]  # fmt: skip
    with pytest.raises(ValueError) as err:
        setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    assert "is not a readable safetensors file" in str(err.value)
    assert "differs from init_from's" not in str(err.value)


def test_init_from_an_mt_checkpoint_of_another_family_names_both_families(tmp_path):
    # A Hugging Face source of another family was named so; an mt checkpoint's failed as a
    # list of missing tensors.
    _write_hf(FAMILIES["gpt_oss"], tmp_path / "hf", torch.float32)
    argv = ["convert", "hf-to-mt", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mt")]
    assert main(argv) == 0
    for source in ("hf", "mt"):
        overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / source}"]
        with pytest.raises(ValueError, match=r"holds a gpt_oss model but the model is "
                           r"qwen3_moe; choose a model of the checkpoint's family"):  # fmt: skip
            setup(resolve_config(get_recipe("tiny"), overrides=overrides))


def test_a_wrong_init_from_fails_before_the_model_is_built_or_run_dir_made(tmp_path, monkeypatch):
    import mt_train.train

    def build_model(config):
        raise AssertionError("the model was built before init_from was checked")

    monkeypatch.setattr(mt_train.train, "build_model", build_model)
    overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / 'typo'}"]
    with pytest.raises(ValueError, match=r"init_from \('.*typo'\) is neither a Hugging Face"):
        setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    assert not (tmp_path / "run").exists()


def test_a_run_directory_given_for_a_checkpoint_is_told_apart_naming_its_newest_step(
    tmp_path, mt_checkpoint, capsys
):
    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(mt_checkpoint, run / "checkpoints" / f"step_{step:08d}")
    newest = run / "checkpoints" / "step_00000004"
    for given in (run, run / "checkpoints"):
        for argv in (
            ["convert", "mt-to-hf", "--checkpoint", str(given), "--out", str(tmp_path / "o")],
            ["generate", "--checkpoint", str(given), "--prompt", "x"],
        ):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"{given} is a run's directory, not a checkpoint: its newest checkpoint " \
                f"is {newest}" in err, err
        overrides = [f"run_dir={tmp_path / 'new'}", f"init_from={given}"]
        with pytest.raises(ValueError, match=rf"its newest checkpoint is {re.escape(str(newest))}"):
            setup(resolve_config(get_recipe("tiny"), overrides=overrides))


def test_a_checkpoint_of_the_other_format_is_named_with_the_conversion_that_reads_it(
    tmp_path, mt_checkpoint, capsys
):
    # A Hugging Face directory where an mt checkpoint is wanted (mt-to-hf, generate), and an
    # mt checkpoint or run directory where a Hugging Face one is (hf-to-mt): say which it is.
    hf = mt_checkpoint.parent / "hf"
    for argv in (
        ["convert", "mt-to-hf", "--checkpoint", str(hf), "--out", str(tmp_path / "o")],
        ["generate", "--checkpoint", str(hf), "--prompt", "x"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{hf} is a Hugging Face directory, not an mt checkpoint; make one with " \
            f"`mt-train convert hf-to-mt --hf {hf} --out DIR`" in err, err
    run = tmp_path / "run"
    shutil.copytree(mt_checkpoint, run / "checkpoints" / "step_00000002")
    newest = run / "checkpoints" / "step_00000002"
    for given, what in ((mt_checkpoint, f"{mt_checkpoint} is an mt checkpoint"),
                        (run, f"{run} is a run's directory; its newest checkpoint is {newest}")):
        argv = ["convert", "hf-to-mt", "--hf", str(given), "--out", str(tmp_path / "o")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{what}, not a Hugging Face directory; export it with `mt-train convert " \
            f"mt-to-hf --checkpoint {newest if given == run else given} --out DIR`" in err, err
    assert not (tmp_path / "o").exists()


def test_a_run_with_a_checkpoint_to_resume_ignores_a_missing_init_from(tmp_path):
    run = [f"run_dir={tmp_path / 'run'}", "training.max_steps=1"]
    pretrain(resolve_config(get_recipe("tiny"), overrides=run))
    state = setup(resolve_config(get_recipe("tiny"), overrides=[*run, "init_from=/gone"]))
    assert state.step == 1


@pytest.mark.parametrize("source", ["hf", "mt"])
def test_init_from_a_source_with_another_rope_theta_and_norm_topk_prob_warns_naming_them(
    tmp_path, caplog, source
):
    import logging

    cfg = resolve_config(get_recipe("tiny"))
    changed = dataclasses.replace(
        cfg.model, rope_theta=1e7, norm_topk_prob=not cfg.model.norm_topk_prob
    )
    _write_hf(changed, tmp_path / "hf", torch.float32)
    if source == "mt":
        convert.hf_to_mt(tmp_path / "hf", tmp_path / "mt")
    overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / source}"]
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    warning = caplog.text
    assert "differs from init_from" in warning
    assert "rope_theta: 10000000.0 -> 10000.0" in warning
    assert f"model.norm_topk_prob={json.dumps(changed.norm_topk_prob)}" in warning
    assert "router_aux_loss_coef" not in warning and "max_position" not in warning


def test_the_overrides_an_init_from_warning_suggests_can_be_pasted_into_a_shell(tmp_path, caplog):
    import logging
    import re
    import shlex

    cfg = resolve_config(get_recipe("tiny"))
    scaling = {"rope_type": "linear", "factor": 2.0}
    changed = dataclasses.replace(cfg.model, rope_theta=1e6, rope_scaling=scaling)
    _write_hf(changed, tmp_path / "hf", torch.float32)
    overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / 'hf'}"]
    with caplog.at_level(logging.WARNING, logger="mt_train"):
        setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    suggested = re.search(r"\(to match it, override (.*)\):", caplog.text).group(1)
    matched = resolve_config(get_recipe("tiny"), overrides=shlex.split(suggested))
    assert matched.model.rope_scaling == scaling and matched.model.rope_theta == 1e6


def test_init_from_a_gpt_oss_saved_without_a_window_reports_no_config_difference(tmp_path):
    # save_hf writes every layer "full_attention" and a window (transformers fails on a null
    # one): the source's config reads back otherwise, with the same window in every layer.
    config = dataclasses.replace(FAMILIES["gpt_oss"], sliding_window=None)
    _write_hf(config, tmp_path / "hf", torch.float32)
    source = convert.read_init_config(tmp_path / "hf")
    assert (source.sliding_window, source.layer_types) != (None, config.layer_types)
    assert convert.init_config_differences(source, config) == {}
    # A window that some layer uses is a difference, named by the fields to override.
    windowed = dataclasses.replace(config, sliding_window=8)
    assert set(convert.init_config_differences(source, windowed)) == {
        "layer_types", "sliding_window"
    }


def test_mt_to_hf_writes_the_tokenizer_eos_id_into_config_json(tmp_path, mt_checkpoint):
    # transformers' generate stops at config.json's eos_token_id when no
    # generation_config.json travels with the weights.
    from mt_data import default_tokenizer_path
    from mt_data.tokenizer import load_tokenizer

    checkpoint = tmp_path / "mt"
    shutil.copytree(mt_checkpoint, checkpoint)
    shutil.copy2(default_tokenizer_path(), checkpoint / "tokenizer.json")
    out = mt_to_hf(checkpoint, tmp_path / "back")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == load_tokenizer(default_tokenizer_path()).eos_id
    original = json.loads((mt_checkpoint.parent / "hf" / "config.json").read_text())
    # No tokenizer_config.json names a BOS or PAD: eos_token_id is the only new key.
    assert {k: v for k, v in config.items() if k != "eos_token_id"} == original
    # A tokenizer.json that is not a tokenizer (the fixture's) leaves config.json alone.
    plain = json.loads((mt_to_hf(mt_checkpoint, tmp_path / "plain") / "config.json").read_text())
    assert "eos_token_id" not in plain


def _write_word_tokenizer(directory, tokenizer_config):
    """A five-token word-level tokenizer.json, and ``tokenizer_config`` beside it."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "hello": 1, "<s>": 2, "</s>": 3, "<pad>": 4}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_mt_to_hf_writes_the_bos_and_pad_ids_tokenizer_config_json_names(tmp_path, mt_checkpoint):
    checkpoint = tmp_path / "mt"
    shutil.copytree(mt_checkpoint, checkpoint)
    pad = {"content": "<pad>", "special": True, "lstrip": False}  # the AddedToken form
    _write_word_tokenizer(checkpoint, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": pad})
    config = json.loads((mt_to_hf(checkpoint, tmp_path / "back") / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 4)


@pytest.mark.parametrize(
    ("tokenizer_config", "expected"),
    [
        # Neither named (HF writes null), and a PAD the vocabulary lacks: left out.
        ({"eos_token": "</s>", "bos_token": None}, {"eos_token_id": 3}),
        ({"eos_token": "</s>", "pad_token": "<|pad|>"}, {"eos_token_id": 3}),
        # Named, but config.json already holds ids (0 and a list included): kept.
        ({"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>"}, None),
    ],
    ids=["undefined", "not_in_vocab", "already_in_config"],
)
def test_special_token_ids_are_left_out_when_undefined_and_never_overwritten(
    tmp_path, tokenizer_config, expected
):
    held = {"bos_token_id": 0, "eos_token_id": [3, 1], "pad_token_id": 1}
    base = {"model_type": "gpt_oss"} | (held if expected is None else {})
    (tmp_path / "config.json").write_text(json.dumps(base))
    _write_word_tokenizer(tmp_path, tokenizer_config)
    convert._add_special_token_ids(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == base | (expected or {})


def test_conversions_show_each_phase_on_stderr_and_read_in_groups_exactly(
    tmp_path, capsys, monkeypatch
):
    # A 60 GB conversion was silent until "wrote". The bars go to stderr; mt-to-hf reads
    # the checkpoint in groups (one DCP load each) so that its bar moves.
    import re

    import mt_train.convert as convert

    monkeypatch.setattr(convert, "_READ_CHUNK_BYTES", 20_000)  # several groups here
    loads = []
    real_load = convert.dcp.load

    def counted_load(tensors, **kwargs):
        loads.append(len(tensors))
        return real_load(tensors, **kwargs)

    monkeypatch.setattr(convert.dcp, "load", counted_load)
    original = tmp_path / "hf"
    _write_hf(FAMILIES["qwen3_moe"], original, torch.bfloat16)
    num_tensors = len(_hf_tensors(original))
    capsys.readouterr()
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    err = capsys.readouterr().err
    assert f"{num_tensors}/{num_tensors}" in err and f"reading {original}" in err
    assert f"writing {tmp_path / 'mt'}" in err
    assert main(["convert", "mt-to-hf", "--checkpoint", str(tmp_path / "mt"), "--out",
                 str(tmp_path / "back"), "--max-shard-size", "40KB"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert len(loads) > 2 and sum(loads) == num_tensors  # every tensor once, in groups
    for phase in (f"reading {tmp_path / 'mt'}", f"writing {tmp_path / 'back'}"):
        (line,) = [s for s in re.split(r"[\r\n]", err) if s.startswith(phase) and "100%" in s]
        done, total = re.search(r"\| ([\d.]+k?B?)/([\d.]+k?B?) ", line).groups()
        assert done == total, line
    before, after = _hf_tensors(original), _hf_tensors(tmp_path / "back")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    argv = ["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "quiet"),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
