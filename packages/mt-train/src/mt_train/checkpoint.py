"""Checkpoints in a canonical, layout-free form, written atomically.

Layout of a run directory::

    <run_dir>/checkpoints/step_00000100/     a complete checkpoint (renamed into place;
                                             the step in 8 digits: a step_100 is warned
                                             of at resume, not resumed)
        .metadata, *.distcp                  PyTorch DCP: every tensor, canonical keys
        train_state.json                     step, data-loader state, resolved config
    <run_dir>/checkpoints/.tmp-step_...      a checkpoint being written (never resumed)
    <run_dir>/checkpoints/.replaced-step_N   step N's checkpoint while it is saved again
                                             (resumed as step N when step_N is missing)

Tensor keys are the Hugging Face parameter names, one key per expert
(``model/<hf key>``, ``optim/<hf key>/exp_avg``, ``optim/<hf key>/exp_avg_sq``), so a
checkpoint does not depend on how parameters are stacked or sharded; beside them are
``optim/step`` (AdamW's step count) and each rank's RNG states ``rng/cpu/rank_<r>`` and,
with CUDA, ``rng/cuda/rank_<r>`` (`_restore_rng` says what a resume on other ranks gets).
The whole checkpoint is written into a temporary directory that is renamed when complete
(every file its ``.metadata`` lists there, whole: run_dir must be on a file system every
node shares): a crash in the middle of a save leaves the previous checkpoint as the newest
complete one. Checkpoints past ``keep_last`` are deleted after the rename; one that cannot
be is a warning.
Saving a step that already has a checkpoint (a resumed run that redoes
steps) moves the old one aside as ``.replaced-step_N`` before the new one takes its name,
and deletes it only then (one that cannot be is a warning too); a crash between the two
renames leaves the old one, which `list_checkpoints` lists as step N and the next save puts
back.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from mt_train.distributed import failing_together, first_line, from_all_ranks

# 2: RNG states per rank (`rng/<device>/rank_<r>`); version 1 wrote one `rng/<device>` for
# every rank, which is still read. An older moetrain refuses 2 as newer than it reads.
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# A step name of fewer digits (``step_9``): renamed by hand, so never listed (see
# `misnamed_checkpoints`).
_UNPADDED_STEP_DIR = re.compile(r"^step_(\d{1,7})$")
_REPLACED = ".replaced-"  # prefix of a step's checkpoint while it is saved again
_STATE_FILE = "train_state.json"
log = logging.getLogger("mt_train")
# DCP warns that it runs without a process group in one process, which is what we want;
# a filter here (not catch_warnings) also covers the background writer's thread.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
# What reading a damaged or incomplete checkpoint raises: a missing or truncated file
# (OSError, EOFError), an unreadable .metadata (UnpicklingError) or train_state.json
# (JSONDecodeError, UnicodeDecodeError), and under a process group DCP's
# CheckpointException around them.
_READ_ERRORS = (
    OSError, EOFError, pickle.UnpicklingError, json.JSONDecodeError, UnicodeDecodeError,
    dcp.CheckpointException,
)  # fmt: skip


def first_failure(err: BaseException) -> BaseException:
    """The error itself, or for DCP's CheckpointException (which wraps every rank's)
    the first rank's own error."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


@contextmanager
def reading_checkpoint(path: str | Path, fix: str):
    """Turns the error of reading a damaged checkpoint into a `ValueError` that names it.

    Args:
        path: the checkpoint directory being read.
        fix: what to do instead, ending the message.
    """
    try:
        yield
    except _READ_ERRORS as err:
        cause = first_failure(err)
        detail = first_line(cause)
        raise ValueError(
            f"checkpoint {path} cannot be read, it is damaged or incomplete "
            f"({type(cause).__name__}{': ' + detail if detail else ''}); {fix}"
        ) from None


@dataclass
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int

    def train_state(self, needed: tuple[str, ...] = ("step",)) -> dict[str, Any]:
        """Returns the JSON part: step and what the trainer saved (data-loader state,
        resolved config, ...).

        Args:
            needed: keys it must hold (else the checkpoint is damaged: a ValueError).
        """
        fix = damaged_run_checkpoint_fix(self.path)
        with reading_checkpoint(self.path, fix):
            state = json.loads((self.path / _STATE_FILE).read_text())
        missing = [k for k in needed if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(
                f"checkpoint {self.path} cannot be read, it is damaged or incomplete (its "
                f"{_STATE_FILE} lacks {missing}); {fix}"
            )
        check_format_version(self.path, state, fix)
        return state


def check_format_version(path: Path, state: dict[str, Any], fix: str) -> None:
    """Raises a ValueError naming the checkpoint unless this code reads its format.

    Versions 1 to `FORMAT_VERSION` are read; a newer one was written by a newer moetrain
    whose files may mean something else, so it is refused rather than misread.

    Args:
        path: the checkpoint directory.
        state: its parsed ``train_state.json``.
        fix: what to do about a file without a usable version (a damaged one).
    """
    version = state.get("format_version") if isinstance(state, dict) else None
    if type(version) is not int or version < 1:  # bool is an int, but not a version
        raise ValueError(
            f"checkpoint {path} cannot be read: its {_STATE_FILE} has format_version "
            f"{version!r}, not a version number from 1 to {FORMAT_VERSION} (a damaged file, "
            f"or one not written by moetrain); {fix}"
        )
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {version}, newer than the newest this "
            f"moetrain reads ({FORMAT_VERSION}); read it with the moetrain version that "
            "wrote it, or upgrade moetrain"
        )


def damaged_run_checkpoint_fix(path: Path) -> str:
    """The way out of a damaged checkpoint in a run directory, for error messages."""
    return (
        f"move {path.name} out of {path.parent} to resume from the checkpoint before it, "
        "or start a new run_dir"
    )


def checkpoint_root(run_dir: str | Path) -> Path:
    """Returns the directory that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def _delete_checkpoint(path: Path) -> None:
    """Deletes a complete checkpoint without ever leaving a partial one under its name.

    It is renamed out of the ``step_*`` (and ``.replaced-step_*``) names first
    (`_set_aside`): a crash in the middle of the delete leaves a ``.old-step_*`` leftover
    (removed by the next save), not a ``step_N`` with its state file but some shards gone,
    which would list as complete.
    """
    shutil.rmtree(_set_aside(path))


def _set_aside(path: Path) -> Path:
    """Renames a checkpoint to a ``.old-step_N`` name no directory has, durably.

    A leftover ``.old-step_N`` is removed first; one that cannot be (read-only files: see
    `_delete_or_warn`) stays, and the checkpoint gets ``.old-step_N.1`` (``.2``, ...): a
    rename onto it would fail (directory not empty) and leave the checkpoint where it was.

    Returns:
        The new path.
    """
    name = f".old-{path.name.removeprefix(_REPLACED)}"
    doomed = path.with_name(name)
    shutil.rmtree(doomed, ignore_errors=True)
    for k in itertools.count(1):
        if not doomed.exists():
            break
        doomed = path.with_name(f"{name}.{k}")
    os.rename(path, doomed)
    _fsync_dir(path.parent)
    return doomed


def is_checkpoint(path: Path) -> bool:
    """Whether `path` holds a complete checkpoint's two last-written files (``.metadata``
    and ``train_state.json``): a run's ``step_N`` or a model-only one."""
    return (path / _STATE_FILE).is_file() and (path / ".metadata").is_file()


def list_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Returns the complete checkpoints under `root`, oldest first.

    A ``.replaced-step_N`` (the old checkpoint of a step being saved again, see
    `_replace_checkpoint`) counts as step N's when there is no ``step_N``: a crash came
    between moving it aside and renaming the new one into place.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Checkpoint] = {}
    for entry in root.iterdir():
        replaced = entry.name.startswith(_REPLACED)
        match = _STEP_DIR.match(entry.name.removeprefix(_REPLACED))
        if match and is_checkpoint(entry):
            step = int(match.group(1))
            if not replaced or not (root / match.group(0)).exists():
                found[step] = Checkpoint(path=entry, step=step)
    return [found[step] for step in sorted(found)]


def misnamed_checkpoints(root: str | Path) -> list[tuple[Path, str]]:
    """Complete checkpoints under `root` that `list_checkpoints` does not list because their
    step has fewer than 8 digits (``step_9``: a directory renamed by hand).

    They are not resumed: a name no save wrote says nothing of whose checkpoint it is.

    Returns:
        (path, the name it would be listed under), by name.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return [
        (entry, f"step_{int(match.group(1)):08d}")
        for entry in sorted(root.iterdir())
        if (match := _UNPADDED_STEP_DIR.match(entry.name)) and is_checkpoint(entry)
    ]


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """Returns the newest complete checkpoint under `root`, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


class _Tensors:
    """The canonical tensors of a model and optimizer, as this rank holds them.

    Nothing is gathered, so saving and loading need no memory beyond the shards. In one
    process the tensors are views of the live parameters and states. Under FSDP2 a
    non-expert parameter (or Adam moment) goes to DCP as its DTensor: each rank writes its
    own shard with its place in the whole, and a load reads each rank's piece of the
    new layout. A sharded expert stack holds whole experts on each rank, so each expert's
    key is a view of this rank's shard, named on that rank only. DCP loads into all of
    them in place.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        params = dict(model.named_parameters())
        canonical = model.to_canonical({name: p.detach() for name, p in params.items()})
        self.tensors = {f"model/{k}": v for k, v in canonical.items()}
        fqn_of = {param: name for name, param in params.items()}
        steps = []
        for param, state in optimizer.state.items() if optimizer is not None else ():
            if not state:
                continue
            fqn = fqn_of[param]
            for moment in ("exp_avg", "exp_avg_sq"):
                for key, view in model.to_canonical({fqn: state[moment]}).items():
                    self.tensors[f"optim/{key}/{moment}"] = view
            steps.append(state["step"])
        if steps:
            assert all(torch.equal(s, steps[0]) for s in steps), "optimizer steps differ"
            self.tensors["optim/step"] = steps[0].detach().clone()
        # Each rank's own generators: one shared key would give every rank one rank's.
        self.tensors[f"rng/cpu/rank_{_rank()}"] = torch.get_rng_state()
        if torch.cuda.is_available():
            self.tensors[f"rng/cuda/rank_{_rank()}"] = torch.cuda.get_rng_state()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_main() -> bool:
    return _rank() == 0


def _match_rng_keys(tensors: dict[str, torch.Tensor], saved: dict) -> None:
    """Points this rank's RNG keys in `tensors` at what the checkpoint holds for it: its
    own ``rng/<device>/rank_<r>``, else the one shared ``rng/<device>`` of checkpoints
    written before per-rank states, else nothing (the key is dropped)."""
    for key in [k for k in tensors if k.startswith("rng/")]:
        shared = key.rsplit("/", 1)[0]  # rng/cpu/rank_3 -> rng/cpu
        if key not in saved:
            value = tensors.pop(key)
            if shared in saved:
                tensors[shared] = value


def _restore_rng(tensors: dict[str, torch.Tensor], step: int) -> None:
    """Sets this rank's generators from the loaded `tensors` (see `_match_rng_keys`).

    A rank the checkpoint holds no state for (a resume on more ranks than saved it) seeds
    them with a number derived from the step and its rank: deterministic, and different
    per rank. A resume on fewer ranks leaves the states of the ranks beyond unused.
    """
    generators = [("cpu", torch.set_rng_state, torch.manual_seed)]
    if torch.cuda.is_available():
        generators.append(("cuda", torch.cuda.set_rng_state, torch.cuda.manual_seed))
    for device, set_state, seed in generators:
        state = tensors.get(f"rng/{device}/rank_{_rank()}", tensors.get(f"rng/{device}"))
        if state is not None:
            set_state(state)
        else:
            digest = hashlib.sha256(f"rng step {step} rank {_rank()}".encode()).digest()
            seed(int.from_bytes(digest[:8], "little") >> 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _naming_the_save(tmp: Path):
    """Adds to an error of a checkpoint write which checkpoint it was and the free disk
    space (a full disk shows as torch's 'unexpected pos ...' from its zip writer). DCP
    wraps an error of its write step, even in one process, in its CheckpointException (a
    BaseException), so that is the type a failed write reaches here as."""
    try:
        yield
    except (OSError, RuntimeError, dcp.CheckpointException) as err:
        try:
            free = f"{shutil.disk_usage(tmp.parent).free / 1e9:.1f} GB free there"
        except OSError:
            free = "free space unknown"
        err.add_note(
            f"mt-train: writing checkpoint {tmp} failed ({free}); the previous complete "
            "checkpoint is untouched and stays the newest"
        )
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Flushes every file under `path`, then every directory (`path` last), to disk: what a
    temporary directory needs before it is renamed into place, so a power loss after the
    rename cannot leave it with empty or missing files."""
    directories = []
    for entry in sorted(path.rglob("*")):
        if entry.is_dir():
            directories.append(entry)
        else:
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [*reversed(directories), path]:
        _fsync_dir(directory)


def _rename_durably(src: Path, dst: Path) -> None:
    """Renames the complete directory `src` to `dst` with both on disk: `src`'s files
    before, the rename (their parent directory) after."""
    _fsync_tree(src)
    os.rename(src, dst)
    _fsync_dir(dst.parent)


def clear_leftovers(root: Path) -> None:
    """Before a save, and as a run starts (main rank): removes what saves that crashed
    left in `root`.

    ``.tmp-step_*`` (never resumed) and ``.old-step_*`` (being deleted) go. A
    ``.replaced-step_N`` is the complete old checkpoint of a step that was being saved
    again: it is renamed back to ``step_N`` when the crash came before the new one took
    that name, else deleted.
    """
    root.mkdir(parents=True, exist_ok=True)
    for stale in (*root.glob(".tmp-step_*"), *root.glob(".old-step_*")):
        shutil.rmtree(stale, ignore_errors=True)
    for replaced in root.glob(f"{_REPLACED}step_*"):
        kept = root / replaced.name.removeprefix(_REPLACED)
        if kept.exists():
            _delete_checkpoint(replaced)
        else:
            os.rename(replaced, kept)
            _fsync_dir(root)


def _replace_checkpoint(new: Path, final: Path) -> None:
    """Puts the complete checkpoint `new` in the place of `final`, a complete checkpoint
    of the same step, so that a crash at any point leaves one of them listed as complete.

    A directory cannot be renamed over a non-empty one, so `final` is first renamed to
    ``.replaced-step_N`` (which `list_checkpoints` lists while ``step_N`` is missing),
    then `new` to `final`; only then is the old one deleted.
    """
    replaced = final.with_name(f"{_REPLACED}{final.name}")
    if replaced.exists():  # a leftover beside a complete final: partial, perhaps
        _delete_checkpoint(replaced)
    os.rename(final, replaced)
    _fsync_dir(final.parent)
    os.rename(new, final)
    _fsync_dir(final.parent)
    step = int(_STEP_DIR.match(final.name).group(1))
    _delete_or_warn(replaced, f"step {step} was saved again: its earlier checkpoint")


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    keep_last: int = 2,
) -> Checkpoint:
    """Saves model, optimizer, RNG and `train_state` atomically as ``step_<step>``.

    Args:
        root: the checkpoints directory of the run.
        step: the number of optimizer steps taken.
        model: the model (provides canonical names via `to_canonical`).
        optimizer: the optimizer whose state to save.
        train_state: JSON-serializable state (data loader, config, ...).
        keep_last: complete checkpoints to keep; older ones are deleted afterwards.

    Returns:
        The new checkpoint.
    """
    root = Path(root)
    tmp = root / f".tmp-step_{step:08d}"
    with failing_together(f"clearing what crashed saves left in {root}"):
        if _is_main():
            clear_leftovers(root)
    tensors = _Tensors(model, optimizer).tensors
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with _naming_the_save(tmp):
            dcp.save(tensors, checkpoint_id=tmp)
    return _finalize(root, step, train_state, keep_last)


def _finalize(root: Path, step: int, train_state: dict[str, Any], keep_last: int) -> Checkpoint:
    """After every rank's tensor files are in ``.tmp-step_N``: state file, rename, prune."""
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    _barrier()  # every rank's files are written
    # Rank 0 alone completes it; the others must not wait for it past its failure.
    with failing_together(f"completing checkpoint {final}"):
        if _is_main():
            _check_every_file_landed(tmp)
            state = {"format_version": FORMAT_VERSION, "step": step, **train_state}
            with open(tmp / _STATE_FILE, "w") as f:
                json.dump(state, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # saving the same step again
                _replace_checkpoint(tmp, final)
            else:
                os.rename(tmp, final)
                _fsync_dir(root)
            for old in list_checkpoints(root)[:-keep_last]:
                _prune(old.path, keep_last)
    return Checkpoint(path=final, step=step)


def _check_every_file_landed(tmp: Path) -> None:
    """Raises unless every file the ``.metadata`` of the DCP write in `tmp` lists is there, as
    long as it says (main rank, before completing the checkpoint): with run_dir on
    node-local disks each node's ranks write their files to their own disk, and a
    checkpoint renamed into place without them would list as complete but never load."""
    with reading_checkpoint(tmp, "the previous complete checkpoint stays the newest"):
        metadata = dcp.FileSystemReader(tmp).read_metadata()
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short = [
        name
        for name, end in sorted(ends.items())
        if not (tmp / name).is_file() or (tmp / name).stat().st_size < end
    ]
    if short:
        raise ValueError(
            f"checkpoint {tmp} lacks {len(short)} of the files its .metadata lists, or holds "
            f"them cut short (e.g. {short[:3]}): every rank writes its own files there, so "
            "run_dir must be on a file system every node shares; the previous complete "
            "checkpoint stays the newest"
        )


def _prune(path: Path, keep_last: int) -> None:
    """Deletes an old checkpoint past `keep_last`; a failure is a warning (`_delete_or_warn`)."""
    _delete_or_warn(path, f"checkpoint.keep_last={keep_last}: the old checkpoint")


def _delete_or_warn(path: Path, what: str) -> None:
    """Deletes an old checkpoint once a newer one is complete; a failure (read-only files,
    another user's) is a warning naming what is left: the new checkpoint is complete and
    the run goes on.

    Args:
        path: the old checkpoint.
        what: how the warning names it, before its path.
    """
    left = path
    try:
        left = _set_aside(path)
        shutil.rmtree(left)
    except OSError as err:
        log.warning(
            "%s %s could not be deleted (%s); what is left of it is %s, delete that by hand",
            what, path, err, left,
        )  # fmt: skip


class AsyncCheckpointer:
    """Saves like `save_checkpoint`, but writes the files in a background thread.

    `save` copies the tensors to CPU memory (the step's values, whatever the optimizer
    does next) and returns; the files go to ``.tmp-step_N`` while training continues.
    The rename that makes the checkpoint complete happens in `wait`, which the trainer
    calls as soon as every rank's `written()` is true (checked after each step), before
    the next `save` and at the end of the run, so a crash while writing leaves only a
    temporary directory that is never resumed. Under torchrun the writer's collectives use their
    own gloo group, apart from training's.

    Args:
        root: the checkpoints directory of the run.
        keep_last: complete checkpoints to keep.
    """

    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self._pending: tuple[Any, int, dict[str, Any]] | None = None
        self._group = None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
    ) -> None:
        """Stages a checkpoint of `step` and starts writing it (finishing any earlier one)."""
        self.wait()
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        with failing_together(f"clearing what crashed saves left in {self.root}"):
            if _is_main():
                clear_leftovers(self.root)
        tensors = _Tensors(model, optimizer).tensors
        tmp = self.root / f".tmp-step_{step:08d}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            future = dcp.async_save(
                tensors,
                checkpoint_id=tmp,
                process_group=self._group,
                no_dist=not dist.is_initialized(),
            )
        self._pending = (future, step, train_state)

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet completed."""
        return self._pending is not None

    def written(self) -> bool:
        """Whether this rank's files of the pending save are all written (no wait)."""
        return self._pending is not None and self._pending[0].done()

    def wait(self) -> Checkpoint | None:
        """Finishes the pending save, if any; returns the checkpoint it completed."""
        if self._pending is None:
            return None
        future, step, train_state = self._pending
        self._pending = None
        with _naming_the_save(self.root / f".tmp-step_{step:08d}"):
            future.result()
        return _finalize(self.root, step, train_state, self.keep_last)


def load_checkpoint(
    checkpoint: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fix: str | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint in place into `model` and `optimizer` and restores RNG state.

    The optimizer's state must already exist (mt_train.optim.init_optimizer_state).

    Args:
        checkpoint: a complete checkpoint.
        model: the model to load into.
        optimizer: the optimizer to load into.
        fix: ends the error of tensors that do not fit the model (None: resume with the
            checkpoint's model.* values).

    Returns:
        The checkpoint's JSON train state.
    """
    if fix is None:
        fix = (
            "resume with the checkpoint's model.* values (its train_state.json has them) or "
            "use a new run_dir"
        )
    tensors = _Tensors(model, optimizer).tensors
    _check_and_load(checkpoint.path, tensors, fix, damaged_run_checkpoint_fix(checkpoint.path))
    if "optim/step" in tensors:
        for state in optimizer.state.values():
            if state:
                state["step"].copy_(tensors["optim/step"])
    _restore_rng(tensors, checkpoint.step)
    return checkpoint.train_state()


def load_model_weights(
    path: str | Path,
    model: nn.Module,
    fix: str = "choose a recipe or model.* overrides that match the source's architecture",
    damaged_fix: str = "choose another init_from",
) -> None:
    """Loads the model tensors of an mt checkpoint into `model` (`init_from`, generate), in
    place.

    Each rank reads only what it holds (its experts, its FSDP2 shards; parameters left on
    the meta device, a pipeline rank's other stages, are skipped); values are cast to the
    parameters' dtypes.

    Args:
        path: a checkpoint directory (a run's ``step_N`` or a model-only one).
        model: the model to fill, sharded or not.
        fix: ends the error of tensors that do not fit the model.
        damaged_fix: ends the error of a checkpoint that cannot be read.
    """
    tensors = {k: v for k, v in _Tensors(model, None).tensors.items()
               if k.startswith("model/") and v.device.type != "meta"}  # fmt: skip
    _check_and_load(Path(path), tensors, fix, damaged_fix)


def _mismatch(path: Path, tensors: dict[str, torch.Tensor], saved: dict, fix: str) -> str | None:
    """The first of this rank's `tensors` the checkpoint lacks or holds in another shape,
    as an error message; None when all match."""
    missing = sorted(set(tensors) - set(saved))
    if missing:
        return (
            f"checkpoint {path} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{missing[:3]}; {fix}"
        )
    for key, tensor in tensors.items():
        shape = getattr(saved[key], "size", None)
        checked = key.startswith(("model/", "optim/")) and shape is not None
        if checked and tuple(shape) != tuple(tensor.shape):
            return (
                f"checkpoint {path}: {key} has shape {tuple(shape)} but the model gives "
                f"{tuple(tensor.shape)}; {fix}"
            )
    return None


def _check_and_load(
    path: Path, tensors: dict[str, torch.Tensor], fix: str, damaged_fix: str
) -> None:
    """Checks this rank's canonical `tensors` against the checkpoint's keys and shapes
    (a model tensor the checkpoint holds that no rank names is an error too), then loads
    them in place; `fix` ends the error messages, `damaged_fix` those of a checkpoint that
    cannot be read."""
    with reading_checkpoint(path, damaged_fix):
        metadata = dcp.FileSystemReader(path).read_metadata()
    saved = metadata.state_dict_metadata
    _match_rng_keys(tensors, saved)
    # Every rank's keys and first mismatch are gathered before anyone raises: under expert
    # parallelism a mismatch can be in some ranks' experts only, and a rank raising alone
    # would leave the others waiting in a collective. Each rank then raises the same error.
    model_keys = {k for k in tensors if k.startswith("model/")}
    gathered = from_all_ranks((sorted(model_keys), _mismatch(path, tensors, saved, fix)))
    errors = [error for _, error in gathered if error is not None]
    if errors:
        raise ValueError(errors[0])
    all_model_keys = set().union(*(keys for keys, _ in gathered))
    extra = sorted(k for k in set(saved) - all_model_keys if k.startswith("model/"))
    if extra:
        raise ValueError(
            f"checkpoint {path} holds {len(extra)} model tensor(s) this model lacks, e.g. "
            f"{extra[:3]}; {fix}"
        )
    with warnings.catch_warnings(), reading_checkpoint(path, damaged_fix):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=path)
