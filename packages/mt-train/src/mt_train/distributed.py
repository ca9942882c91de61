"""Process-group setup for runs under torchrun (or alone), and small reductions.

`mt-train pretrain` runs as one process, or under torchrun with one process per GPU
(NCCL) or, on CPU, gloo. torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) is read here and nowhere else.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Env:
    """Where this process sits: rank, world size and device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on the rank that logs and renames checkpoints."""
        return self.rank == 0


def init_distributed(device_type: str, timeout_s: float) -> Env:
    """Joins torchrun's process group if launched by it; otherwise a one-process Env.

    Args:
        device_type: "cuda" or "cpu" (NCCL or gloo).
        timeout_s: collective timeout; a hung collective ends with an error after it.

    Returns:
        The process's Env.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
    return Env(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def all_reduce(
    value: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduces a tensor over `group` (None: the world) in place (no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(value, op=ops[op], group=group)
    return value


def from_all_ranks(value: Any) -> list[Any]:
    """Every rank's picklable `value`, in rank order (just this one's in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    """Waits for every rank (no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def leave_process_group() -> None:
    """Ends this process's part in the process group after a run every rank finished
    (no-op without one).

    The ranks meet at a barrier, so none leaves while a peer still talks to the store that
    rank 0 serves, then destroy the group, as torchtitan does at the end of training. Left
    to the interpreter's exit, gloo's teardown aborted a rank of a finished run now and then
    ("terminate called without an active exception", SIGABRT: torchrun reported the run
    failed; 3 runs in 10 of two CPU ranks with checkpoint.async_save).
    """
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def first_line(err: BaseException) -> str:
    """The first line of an error's message, at most 300 characters ("" for none): what a
    one-line report quotes of it."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


class RankFailedError(RuntimeError):
    """Another rank failed in a step of setup that `failing_together` guarded."""


def _flag_device() -> torch.device:
    """Where a collective's tensor must live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def failing_together(what: str):
    """Runs a block that may fail on some ranks only, then every rank learns of it.

    A step that only the main rank performs (creating and locking the run directory,
    building the default corpus, writing config.json) or that may fail on one node only
    (a file it lacks) must not leave the other ranks waiting at the next collective until
    ``parallel.timeout_s``. After the block all ranks all-reduce a failure flag (one
    one-element all-reduce when nothing failed); when some rank failed, the failed ranks
    re-raise their own error and the others raise a `RankFailedError` naming the first
    failed rank and its error. The block itself must hold no collective. Without a
    process group this is a no-op.

    Args:
        what: the step, for the others' error ("creating the run directory").
    """
    error: Exception | None = None
    try:
        yield
    except Exception as err:  # every rank must reach the all-reduce below
        error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor(int(error is not None), device=_flag_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if int(failed):
            share_failure(error, what)
    if error is not None:
        raise error


def share_failure(error: Exception | None, what: str) -> None:
    """Raises on every rank once all ranks know that some rank failed (every rank calls it).

    A failed rank re-raises its `error`; the others raise a `RankFailedError` naming the
    first failed rank and its error (the ranks exchange the messages here).

    Args:
        error: this rank's error, or None.
        what: the step, for the others' error ("creating the run directory").
    """
    reports: list[str | None] = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(reports, mine)
    if error is not None:
        raise error
    rank, report = next((r, m) for r, m in enumerate(reports) if m is not None)
    raise RankFailedError(
        f"rank {rank} failed while {what} ({report}); this rank stops too, "
        f"rank {rank}'s output has the details"
    )
