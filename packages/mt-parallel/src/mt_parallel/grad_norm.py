"""Global gradient-norm clipping over parameters sharded on different meshes.

With pp = 1 every gradient element lives on exactly one rank of the world: non-expert
gradients are sharded over (dp, cp, ep), expert gradients over (dp, cp) and distinct
across ep. So the global squared norm is one all-reduce of each rank's local sum of
squares (expert norms are thereby summed over ep). `torch.nn.utils.clip_grad_norm_`
cannot mix DTensors of two meshes, hence this function.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None
) -> float:
    """Scales gradients so their global L2 norm is at most `max_norm`.

    Args:
        parameters: parameters whose `.grad` to clip (DTensor or plain).
        max_norm: the bound; `math.inf` only measures.
        group: the ranks among which every gradient element lives once (the world
            when pp = 1); None for one process.

    Returns:
        The global norm before clipping (inf/nan if a gradient is not finite).
    """
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if grads:
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    else:
        sq = torch.zeros((), dtype=torch.float32)
    if group is not None:
        dist.all_reduce(sq, group=group)
    total = float(sq.sqrt())
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total
