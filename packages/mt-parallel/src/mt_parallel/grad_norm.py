"""Global gradient-norm clipping over parameters sharded on different meshes.

With pp = 1 every gradient element lives on exactly one rank of the world: non-expert
gradients are sharded over (dp, cp, ep), expert gradients over (dp, cp) and distinct
across ep. So the global squared norm is one all-reduce of each rank's local sum of
squares (expert norms are thereby summed over ep). `torch.nn.utils.clip_grad_norm_`
cannot mix DTensors of two meshes, hence this function.

Eager code (`g.float().pow(2).sum()` per gradient) writes an fp32 square of every
gradient before summing it. Here each gradient's norm is one reduction that reads it
once and sums its squares in fp32 whatever its dtype (in fp64 for fp64 gradients and on
CPU); the float of the global norm is the one host sync. Clipping scales in place.
Small gradients go through PyTorch's multi-tensor kernels (`_foreach_norm`,
`_foreach_mul_`, as `clip_grad_norm_(foreach=True)` does): one launch per (device,
dtype) group instead of one per tensor. Large ones keep a kernel each, which streams a
large tensor at least as fast as the multi-tensor kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Gradients of at least this many elements get per-tensor kernels. Measured on one H200
# (median of 11 timings, fp32 and bf16 lists): at 2**24 elements a per-tensor norm is
# about as fast as `_foreach_norm` and a per-tensor `mul_` faster than `_foreach_mul_`;
# at 2**22 the multi-tensor kernels win. On the gradient shapes of Qwen3-30B-A3B cut to
# 4 layers (51 tensors, 3.1e9 elements, 14 tensors of 2**24 or more holding 3.0e9) the
# per-tensor kernels took 13-29% less time than the multi-tensor ones, for the norm and
# for the scaling alike.
_PER_TENSOR_MIN_NUMEL = 1 << 24


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _norm_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient's squares are summed in: fp32 (fp64 for fp64 gradients).

    CPU norm kernels add fp32 squares one after another (relative error 7e-6 at 8e5
    randn elements, 8e-5 at 4e6, torch 2.11), so CPU gradients are summed in fp64.
    """
    return torch.promote_types(dtype, torch.float64 if device.type == "cpu" else torch.float32)


def _reduce_device(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.device:
    """Where the squared norm is summed and all-reduced: the first gradient's device when
    the group's backend takes it, else the device that backend communicates from (an NCCL
    all-reduce takes CUDA tensors only: a rank that holds no gradient, an EP rank without a
    group's experts, or CPU-offloaded gradients, would fail it with a CPU sum)."""
    if group is None:
        return grads[0].device if grads else torch.device("cpu")
    # "gloo", "nccl", ... or "cpu:gloo,cuda:nccl" (not listed: has a CPU backend).
    device_types = dist.Backend.backend_capability.get(dist.get_backend(group), ["cpu"])
    if grads and grads[0].device.type in device_types:
        return grads[0].device
    if "cpu" in device_types:
        return torch.device("cpu")
    return torch.device(device_types[0], torch.accelerator.current_device_index())


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    # A multi-tensor kernel takes one device and one dtype; PyTorch sends a mixed list
    # through its per-tensor fallback.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None
) -> float:
    """Scales gradients so their global L2 norm is at most `max_norm`.

    Args:
        parameters: parameters whose `.grad` to clip (DTensor or plain).
        max_norm: the bound, >= 0; `math.inf` only measures.
        group: the ranks among which every gradient element lives once (the world
            when pp = 1); None for one process.

    Returns:
        The global norm before clipping (inf/nan if a gradient is not finite; on GPU
        also if one gradient's own norm, summed in fp32, passes 1.8e19).
    """
    if not max_norm >= 0:  # a negative bound flipped every gradient's sign; NaN clipped nothing
        raise ValueError(
            f"max_norm ({max_norm}) must be >= 0; pass math.inf to measure without clipping"
        )
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    large = [g for g in grads if g.numel() >= _PER_TENSOR_MIN_NUMEL]
    small = _by_device_and_dtype([g for g in grads if g.numel() < _PER_TENSOR_MIN_NUMEL])
    norms = [torch.linalg.vector_norm(g, dtype=_norm_dtype(g.device, g.dtype)) for g in large]
    for (device, dtype), tensors in small.items():
        # Without `dtype` the norms of bf16 gradients come back rounded to bf16.
        norms += torch._foreach_norm(tensors, 2.0, dtype=_norm_dtype(device, dtype))
    # Squared and summed in fp64 on the device the all-reduce expects: in fp32 the square
    # of any norm past 1.8e19 was inf, so finite gradients read as non-finite and were
    # left unclipped.
    device = _reduce_device(grads, group)
    if norms:
        sq = torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(sq, group=group)
    total = float(sq.sqrt())
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in large:
            g.mul_(scale)
        for (_, dtype), tensors in small.items():
            # The factor as a 0-d CPU tensor of fp32 (fp64 for fp64) multiplies every
            # gradient exactly as `g.mul_(scale)` does (checked on CPU and on an H200);
            # a Python float is rounded to bf16 first for bf16 gradients on CPU, and a
            # CUDA tensor gave other bf16 and fp16 results on the H200.
            factor = torch.tensor(scale, dtype=torch.promote_types(dtype, torch.float32))
            torch._foreach_mul_(tensors, factor)
    return total
