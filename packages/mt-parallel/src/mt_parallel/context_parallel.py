"""Context parallelism: each CP rank holds 2 of 2·cp sequence chunks, in zigzag order.

Causal attention over a sequence split into 2·cp chunks is balanced when rank r takes
chunks r and 2·cp−1−r (an early, cheap chunk and a late, expensive one). Each rank
reads only its tokens (plus one extra label token per chunk), computes RoPE at the
global positions, and attends its queries to the keys and values of the whole sequence,
which the CP ranks all-gather (the backward reduces the key/value gradients back to
their owners). The attention mask comes from the global positions of the queries and
keys, so causal, sliding-window and sink attention need no special case. Per-document
positions of packed samples (document masking) are refused: that mask needs cp = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mt_ops import attention
from mt_parallel.dims import check_cp_divides_seq_len


def zigzag_ranges(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """Column ranges of a seq_len+1 sample that CP rank `cp_rank` reads.

    Args:
        seq_len: S, tokens per sequence (inputs); a multiple of 2·cp.
        cp: context-parallel size.
        cp_rank: this rank's index in the CP group.

    Returns:
        Two `(start, end)` ranges, each a chunk of S/(2·cp) inputs plus one label token.
    """
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp ({cp}) must be >= 1 and cp_rank ({cp_rank}) in [0, {cp})")
    check_cp_divides_seq_len(cp, seq_len)
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return [(first * chunk, (first + 1) * chunk + 1), (second * chunk, (second + 1) * chunk + 1)]


def zigzag_positions(seq_len: int, cp: int, cp_rank: int) -> Tensor:
    """Global positions of the input tokens a CP rank holds (int64 [S / cp])."""
    return torch.cat([torch.arange(a, b - 1) for a, b in zigzag_ranges(seq_len, cp, cp_rank)])


def split_sample(tokens: Tensor, ranges: list[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Cuts inputs, labels and positions out of [B, S+1] samples for the given ranges.

    Args:
        tokens: int64 [B, S+1] whole samples, or [B, Σ(end−start)] with only the columns
            of `ranges` (as mt-data's `take(token_ranges=...)` returns them).
        ranges: the `(start, end)` column ranges of `zigzag_ranges`.

    Returns:
        `(inputs [B, L], labels [B, L], positions [L])`, L = Σ(end − start − 1).
    """
    # The layouts are told apart by width: Σ(end − start) columns when cut, S+1 when
    # whole. These differ for every cp; for cp = 1 the two chunks share a label column,
    # so the cut layout is the wider one.
    cut, last = sum(b - a for a, b in ranges), max(b for _, b in ranges)
    whole = tokens.dim() == 2 and tokens.shape[1] != cut
    if tokens.dim() != 2 or (whole and tokens.shape[1] < last):
        fix = (
            "one sample needs its batch dim: pass tokens[None]"
            if tokens.dim() == 1
            else "pass the samples the ranges were made for"
        )
        raise ValueError(
            f"tokens shape ({tuple(tokens.shape)}) must be [B, S+1] (whole samples, at "
            f"least {last} columns) or [B, {cut}] (only the columns of ranges {ranges}); {fix}"
        )
    inputs, labels, offset = [], [], 0
    for start, end in ranges:
        cols = tokens[:, start:end] if whole else tokens[:, offset : offset + end - start]
        offset += end - start
        inputs.append(cols[:, :-1])
        labels.append(cols[:, 1:])
    positions = torch.cat([torch.arange(a, b - 1) for a, b in ranges]).to(tokens.device)
    return torch.cat(inputs, dim=1), torch.cat(labels, dim=1), positions


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence dim (2) of [B, H, S_local, D]; the backward
    reduce-scatters the gradient back to each rank's chunk."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # Reduce-scattered from a copy with the ranks' chunks stacked along dim 0
        # [cp·B, H, S_local, D]: the incoming gradient may be another branch's too (an add's
        # backward hands both operands one tensor), so it must not be reduced in place.
        parts = torch.cat(grad.chunk(dist.get_world_size(ctx.group), dim=2))
        out = parts.new_empty((grad.shape[0], *parts.shape[1:]))  # [B, H, S_local, D]
        dist.reduce_scatter_tensor(out, parts, group=ctx.group)
        return out, None


def _check_global_positions(kv_positions: Tensor) -> None:
    """Raises ValueError unless each row of the gathered positions [S] or [B, S] holds
    consecutive positions, each once (a whole sequence, in zigzag order)."""
    sorted_positions = kv_positions.sort(dim=-1).values
    if not bool((sorted_positions.diff(dim=-1) == 1).all()):
        raise ValueError(
            "context parallelism needs the global positions of each whole sequence (each "
            "position once over the cp ranks, consecutive: zigzag_positions or "
            "rank_batch_slices' positions), but these repeat or skip positions; "
            "per-document positions of packed samples (document masking) need cp=1, "
            "since the context-parallel core masks by global position only"
        )


class ContextParallelAttention:
    """Attention core for CP: queries of this rank against all-gathered keys/values.

    One instance can serve every attention module of a model: it checks each new
    positions tensor once (one host sync), not once per layer.

    Args:
        group: the CP process group.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        # The last positions found to be global ones, with their version: the layers of
        # one forward pass the same tensor. Held, so its identity is not reused.
        self._checked: tuple[Tensor, int] | None = None

    def __call__(
        self, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, *, positions_S: Tensor,
        scale: float | None = None, window: int | None = None, sinks_H: Tensor | None = None,
    ) -> Tensor:
        """Attends this rank's queries to the whole sequence's keys and values.

        Args:
            q_BHSD: queries of this rank's tokens (RoPE applied at global positions).
            k_BHSD: keys of this rank's tokens.
            v_BHSD: values of this rank's tokens.
            positions_S: global positions of this rank's tokens, [S_local] or [B, S_local]
                (`zigzag_positions`); required.
            scale: softmax scale (None: 1/sqrt(head dim)).
            window: sliding-window size, None for full causal attention.
            sinks_H: per-head attention-sink logits, or None.

        Returns:
            Attention output for this rank's queries [B, H, S_local, Dv].
        """
        if positions_S is None:
            raise ValueError(
                "context parallelism needs position_ids: the global positions of this rank's "
                "tokens (zigzag_positions(seq_len, cp, cp_rank), or rank_batch_slices' positions)"
            )
        k_all = _GatherSeq.apply(k_BHSD, self.group)
        v_all = _GatherSeq.apply(v_BHSD, self.group)
        parts = [torch.empty_like(positions_S) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, positions_S.contiguous(), group=self.group)
        # Along the sequence dim, in rank order as k_all and v_all: [S] or [B, S].
        kv_positions = torch.cat(parts, dim=-1)
        # Inference tensors (torch.inference_mode) have no version counter.
        version = 0 if positions_S.is_inference() else positions_S._version
        checked = self._checked
        if checked is None or checked[0] is not positions_S or checked[1] != version:
            _check_global_positions(kv_positions)  # equal on every rank: all raise or none
            self._checked = (positions_S, version)
        return attention(
            q_BHSD, k_all, v_all, causal=True, scale=scale, window=window, sinks=sinks_H,
            q_positions=positions_S, kv_positions=kv_positions,
        )
