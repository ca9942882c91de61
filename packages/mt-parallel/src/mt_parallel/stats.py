"""Router statistics reduced over the ranks that share one load-balancing loss.

The load-balancing loss of a micro-batch must not depend on the layout. Its statistics
(mt_models.RouterStats) come in two kinds:

- micro-batch sums (`*_E`, `num_tokens`, `z_sum`) cover all tokens: they are summed
  over dp·cp·ep;
- per-sequence sums (`*_BE`, `num_tokens_B`) cover each sequence: they are summed over
  cp (the ranks holding other chunks of the same sequences) and then gathered, in batch
  order, over dp·ep (the ranks holding other sequences).

Every rank then computes the same global loss. The gradient each rank needs is that of
the global loss with respect to its *own* statistics, so the backward of these
collectives is the identity (sum) or this rank's slice (gather): the FSDP gradient
reduction adds up the ranks' contributions afterwards, as for any other loss term.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from mt_models import RouterStats


class _SumKeepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherKeepSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.rank, ctx.rows = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def sum_across(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-reduce sum whose gradient passes to the local input unchanged (any dtype)."""
    return _SumKeepGrad.apply(x, group)


def gather_across(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-gather along dim 0 (rank order) whose backward keeps this rank's rows."""
    return _GatherKeepSlice.apply(x, group)


def reduce_router_stats(
    stats: RouterStats,
    *,
    everyone: dist.ProcessGroup,
    batch: dist.ProcessGroup,
    context: dist.ProcessGroup,
) -> RouterStats:
    """Makes one layer's router statistics global for its micro-batch.

    Args:
        stats: this rank's statistics of one layer and micro-batch.
        everyone: the dp·cp·ep ranks (micro-batch sums).
        batch: the dp·ep ranks, in batch-rank order (per-sequence gathers).
        context: the cp ranks (per-sequence sums).

    Returns:
        The statistics of the whole micro-batch, equal on every rank.
    """
    per_sequence = {}
    for name in ("tokens_per_expert_BE", "prob_sum_BE", "num_tokens_B"):
        value = getattr(stats, name)
        if dist.get_world_size(context) > 1:
            value = sum_across(value, context)
        if dist.get_world_size(batch) > 1:
            value = gather_across(value, batch)
        per_sequence[name] = value
    return replace(
        stats,
        tokens_per_expert_E=sum_across(stats.tokens_per_expert_E, everyone),
        prob_sum_E=sum_across(stats.prob_sum_E, everyone),
        num_tokens=sum_across(stats.num_tokens, everyone),
        z_sum=sum_across(stats.z_sum, everyone),
        **per_sequence,
    )



def router_stats_reducer(mesh) -> Callable[[RouterStats], RouterStats]:
    """:func:`reduce_router_stats` over a :class:`~mt_parallel.mesh.ParallelMesh`'s groups
    (a model's ``router_stats_reducer``, or the pipeline's ``stats_reducer``)."""
    return partial(
        reduce_router_stats,
        everyone=mesh.group("dp_cp_ep"),
        batch=mesh.group("dp_ep"),
        context=mesh.group("cp"),
    )
