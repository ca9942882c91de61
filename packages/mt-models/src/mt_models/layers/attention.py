"""Grouped-query self-attention (optional per-head QK-norm, biases, sinks, sliding window)
and the swappable attention core.

Legend: B batch, S sequence, D model dim, H query heads, G key/value heads, Dh head dim.

Every attention module computes q, k, v and RoPE itself, then calls its ``attention_core``::

    out_BHSD = self.attention_core(q_BHSD, k_BHSD, v_BHSD, positions_S=..., scale=...,
                                   window=..., sinks_H=...)

The default core, :class:`LocalAttention`, calls ``mt_ops.attention`` over the whole
sequence. mt-parallel swaps in a context-parallel core with the same call (it all-gathers
the keys and values of the CP ranks).
"""

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from mt_models.layers.linear import Linear
from mt_models.layers.norm import RMSNorm
from mt_models.layers.rope import RotaryEmbedding
from mt_ops import apply_rope, attention


@runtime_checkable
class AttentionCore(Protocol):
    """Softmax attention over q, k, v that are already projected and rotated."""

    def __call__(
        self,
        q_BHSD: Tensor,
        k_BHSD: Tensor,
        v_BHSD: Tensor,
        *,
        positions_S: Tensor | None,
        scale: float,
        window: int | None,
        sinks_H: Tensor | None,
    ) -> Tensor:
        """Causal attention of the layer.

        Args:
            q_BHSD: Queries [B, H, S, Dqk].
            k_BHSD: Keys [B, G, S, Dqk] (G divides H).
            v_BHSD: Values [B, G, S, Dv] (Dv may differ from Dqk: MLA).
            positions_S: The tokens' positions [S] or [B, S] as the caller gave them (what
                set RoPE), or None for ``arange(S)``.
            scale: Multiplier of q·k.
            window: Sliding window in keys (the query's own included), or None for full
                causal attention.
            sinks_H: fp32 sink logit per query head [H], or None.

        Returns:
            ``out`` [B, H, S, Dv].
        """
        ...


class LocalAttention:
    """The single-device core: ``mt_ops.attention`` over the whole local sequence.

    It masks by index: query i sees keys 0..i (the last ``window`` of them in a windowed
    layer). Explicit ``positions_S`` mark packed documents: a new document starts wherever a
    position is not the previous one plus 1 (transformers' rule for finding them), and
    attention stays inside each document. None (the default positions) is one document, on
    the fast path. A context-parallel core, holding slices of the sequence, reads the
    positions its own way.
    """

    def __call__(
        self,
        q_BHSD: Tensor,
        k_BHSD: Tensor,
        v_BHSD: Tensor,
        *,
        positions_S: Tensor | None,
        scale: float,
        window: int | None,
        sinks_H: Tensor | None,
    ) -> Tensor:
        """See :class:`AttentionCore`."""
        documents = None if positions_S is None else document_ids(positions_S)
        return attention(
            q_BHSD,
            k_BHSD,
            v_BHSD,
            causal=True,
            scale=scale,
            window=window,
            sinks=sinks_H,
            q_document_ids=documents,
            kv_document_ids=documents,
        )


def document_ids(positions: Tensor) -> Tensor:
    """Document index of each token of packed rows: it grows by one wherever a position is
    not the previous one plus 1 (transformers' ``find_packed_sequence_indices``).

    Args:
        positions: Token positions [S] or [B, S].

    Returns:
        int64 ids of the same shape, starting at 0 in each row.
    """
    step = torch.diff(positions, dim=-1)  # [..., S-1]
    starts = torch.cat([torch.zeros_like(positions[..., :1]), (step != 1).long()], dim=-1)
    return starts.cumsum(dim=-1)


class GQAAttention(nn.Module):
    """Causal self-attention with G key/value heads shared by H query heads.

    Qwen3: per-head RMSNorm of q and k before RoPE (``qk_norm``), no biases. GPT-OSS:
    biases on all four projections, one learned sink logit per head (``self_attn.sinks``),
    sliding-window layers.

    Args:
        hidden_size: D.
        num_heads: H, query heads.
        num_kv_heads: G, key/value heads (divides H).
        head_dim: Dh.
        rotary: RoPE tables over Dh.
        eps: Epsilon of the QK-norms.
        bias: Whether the q/k/v/o projections carry a bias.
        qk_norm: RMS-normalize q and k per head (Qwen3).
        sinks: Learn one sink logit per query head (GPT-OSS).
        window: Sliding window in keys, or None for full causal attention.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        *,
        eps: float = 1e-6,
        bias: bool = False,
        qk_norm: bool = False,
        sinks: bool = False,
        window: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.scale = head_dim**-0.5
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.rotary = rotary
        # Swapped by mt-parallel for a context-parallel core.
        self.attention_core: AttentionCore = LocalAttention()

    def forward(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Attends causally over the sequence.

        Args:
            x_BSD: Normed input [B, S, D].
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            Attention output projected back to [B, S, D].
        """
        batch, seq_len, _ = x_BSD.shape
        rope_positions = _or_arange(position_ids, seq_len, x_BSD.device)
        q_BSHD = self.q_proj(x_BSD).view(batch, seq_len, self.num_heads, self.head_dim)
        k_BSGD = self.k_proj(x_BSD).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        v_BSGD = self.v_proj(x_BSD).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BSHD, k_BSGD = self.q_norm(q_BSHD), self.k_norm(k_BSGD)
        cos, sin = self.rotary(rope_positions)  # [S or B,S, Dh]
        q_BSHD = apply_rope(q_BSHD, cos, sin)
        k_BSGD = apply_rope(k_BSGD, cos, sin)
        out_BHSD = self.attention_core(
            q_BSHD.transpose(1, 2),
            k_BSGD.transpose(1, 2),
            v_BSGD.transpose(1, 2),
            positions_S=position_ids,
            scale=self.scale,
            window=self.window,
            sinks_H=self.sinks,
        )  # [B, H, S, Dh]
        out_BSD = out_BHSD.transpose(1, 2).reshape(batch, seq_len, self.num_heads * self.head_dim)
        return self.o_proj(out_BSD)

    def score_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of q·k and p·v per token: ``2 · H · (Dqk + Dv) · context``."""
        return 2 * self.num_heads * 2 * self.head_dim * causal_context(seq_len, self.window)


def _or_arange(position_ids: Tensor | None, seq_len: int, device: torch.device) -> Tensor:
    return torch.arange(seq_len, device=device) if position_ids is None else position_ids


def causal_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a query attends to, ARCHITECTURE §8's convention.

    ``S/2`` for full causal attention; with a window ``W' = min(W, S)``:
    ``W' − W'²/(2S)``, the same continuous count (the integral of ``min(x, W')`` over
    ``0 ≤ x ≤ S``, divided by S; ``S/2`` at W' = S). The exact mean number of keys,
    ``min(i + 1, W')`` over i < S, is ``W'/(2S)`` more (``(S + 1)/2`` without a window).

    Args:
        seq_len: S.
        window: W, or None.

    Returns:
        The mean context length.
    """
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)
