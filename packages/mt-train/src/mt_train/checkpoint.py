"""Checkpoints in a canonical, layout-free form, written atomically.

Layout of a run directory::

    <run_dir>/checkpoints/step_00000100/     a complete checkpoint (renamed into place)
        .metadata, *.distcp                  PyTorch DCP: every tensor, canonical keys
        train_state.json                     step, data-loader state, resolved config
    <run_dir>/checkpoints/.tmp-step_...      a checkpoint being written (never resumed)

Tensor keys are the Hugging Face parameter names, one key per expert
(``model/<hf key>``, ``optim/<hf key>/exp_avg``, ``optim/<hf key>/exp_avg_sq``), so a
checkpoint does not depend on how parameters are stacked or sharded. The whole
checkpoint is written into a temporary directory that is renamed when complete: a
crash in the middle of a save leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_STATE_FILE = "train_state.json"


@dataclass
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int

    def train_state(self) -> dict[str, Any]:
        """Returns the JSON part: step, data-loader state and resolved config."""
        return json.loads((self.path / _STATE_FILE).read_text())


def checkpoint_root(run_dir: str | Path) -> Path:
    """Returns the directory that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Returns the complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / _STATE_FILE).is_file() and (entry / ".metadata").is_file():
            found.append(Checkpoint(path=entry, step=int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """Returns the newest complete checkpoint under `root`, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Maps canonical keys to (views of) the live model and optimizer tensors."""
    tensors = {f"model/{k}": v.detach() for k, v in model.canonical_parameters().items()}
    fqn_of = {param: name for name, param in model.named_parameters()}
    steps = []
    for param, state in optimizer.state.items():
        if not state:
            continue
        fqn = fqn_of[param]
        for moment in ("exp_avg", "exp_avg_sq"):
            for key, view in model.to_canonical({fqn: state[moment]}).items():
                tensors[f"optim/{key}/{moment}"] = view
        steps.append(state["step"])
    if steps:
        assert all(torch.equal(s, steps[0]) for s in steps), "optimizer steps differ"
        tensors["optim/step"] = steps[0].detach().clone()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    return tensors


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_tensors(model, optimizer), checkpoint_id=tmp)
    state = {"format_version": FORMAT_VERSION, "step": step, **train_state}
    with open(tmp / _STATE_FILE, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # saving the same step again: swap, never delete before rename
        stale = root / f".old-step_{step:08d}"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        os.rename(tmp, final)
        shutil.rmtree(stale)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old.path)
    return Checkpoint(path=final, step=step)


def load_checkpoint(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Loads a checkpoint in place into `model` and `optimizer` and restores RNG state.

    The optimizer's state must already exist (mt_train.optim.init_optimizer_state).

    Args:
        checkpoint: a complete checkpoint.
        model: the model to load into.
        optimizer: the optimizer to load into.

    Returns:
        The checkpoint's JSON train state.
    """
    tensors = _tensors(model, optimizer)
    metadata = dcp.FileSystemReader(checkpoint.path).read_metadata()
    missing = sorted(set(tensors) - set(metadata.state_dict_metadata))
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint.path} lacks {len(missing)} tensor(s) the model needs, "
            f"e.g. {missing[:3]}; was it written for a different model config?"
        )
    if "rng/cuda" in tensors and "rng/cuda" not in metadata.state_dict_metadata:
        del tensors["rng/cuda"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=checkpoint.path)
    if "optim/step" in tensors:
        for state in optimizer.state.values():
            if state:
                state["step"].copy_(tensors["optim/step"])
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return checkpoint.train_state()
