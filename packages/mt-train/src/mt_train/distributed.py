"""Process-group setup for runs under torchrun (or alone), and small reductions.

`mt-train pretrain` runs as one process, or under torchrun with one process per GPU
(NCCL) or, on CPU, gloo. torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) is read here and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

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


def all_reduce(value: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduces a tensor over the world in place (no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(value, op=ops[op])
    return value


def barrier() -> None:
    """Waits for every rank (no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
