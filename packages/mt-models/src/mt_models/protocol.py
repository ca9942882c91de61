"""The five-phase decoder-layer protocol: attend, dispatch, experts, combine, aggregate.

Legend: B batch, S sequence, T tokens (B·S), D model dim, E experts, K top-k, R routed rows.

A decoder layer splits its forward into phases so that a pipeline schedule can run each as
its own autograd segment and overlap one micro-batch's expert traffic with another's
compute (ARCHITECTURE §2-3)::

    routed = layer.attend(x_BSD, position_ids)                    # norm, attention, router
    tokens_RD, tokens_per_expert_E, handle = layer.dispatcher.dispatch(routed)
    expert_out_RD = layer.experts(tokens_RD, tokens_per_expert_E)  # grouped GEMMs
    expert_out_TD = layer.dispatcher.combine(expert_out_RD, handle)  # top-k weighted sum
    out_BSD = layer.aggregate(expert_out_TD, routed)              # + shared, + residual

``forward`` is exactly this composition. A dense layer (no experts) returns a ``Routed``
with no top-k, and its forward skips the dispatcher: its ``experts`` phase runs the dense
MLP over all T tokens.
"""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class RouterStats:
    """Per-layer router statistics of one micro-batch: sums, so ranks can add them up.

    The ``*_E`` fields and ``num_tokens``/``z_sum`` cover all tokens of the micro-batch:
    sum them over every rank that holds other tokens of the global batch (dp · cp · ep).
    The per-sequence ``*_BE``/``num_tokens_B`` fields cover each sequence: sum them only over
    ranks holding other pieces of the same sequences (cp), never over data-parallel ranks.

    Attributes:
        tokens_per_expert_E: How many tokens chose each expert (fp32 [E], no gradient).
        prob_sum_E: Sum over tokens of each expert's router probability (fp32 [E]; carries
            the gradient to the router).
        num_tokens: Number of tokens T these sums cover (an int64 scalar tensor, so it can
            be all-reduced like the sums).
        z_sum: Sum over tokens of ``logsumexp(router_logits)²`` (fp32 scalar; router z-loss).
        tokens_per_expert_BE: Per-sequence expert counts (fp32 [B, E], no gradient).
        prob_sum_BE: Per-sequence probability sums (fp32 [B, E]).
        num_tokens_B: Tokens of each sequence (int64 [B]).
    """

    tokens_per_expert_E: Tensor
    prob_sum_E: Tensor
    num_tokens: Tensor
    z_sum: Tensor
    tokens_per_expert_BE: Tensor
    prob_sum_BE: Tensor
    num_tokens_B: Tensor


@dataclass(frozen=True)
class Routed:
    """What ``attend`` hands to the dispatcher and, later, to ``aggregate``.

    Attributes:
        hidden_TD: Normed hidden states the experts consume [T, D].
        residual_TD: Residual stream after attention [T, D].
        batch_shape: (B, S), restored by ``aggregate``.
        topk_ids_TK: Chosen experts [T, K] (int64), or None for a dense layer.
        topk_weights_TK: Their weights [T, K] (fp32), or None for a dense layer.
        shared_out_TD: Shared-expert output [T, D], or None without a shared expert.
        router_stats: Statistics for the load-balancing loss, or None for a dense layer.
    """

    hidden_TD: Tensor
    residual_TD: Tensor
    batch_shape: tuple[int, int]
    topk_ids_TK: Tensor | None = None
    topk_weights_TK: Tensor | None = None
    shared_out_TD: Tensor | None = None
    router_stats: RouterStats | None = None


@dataclass(frozen=True)
class LayerOutput:
    """What a decoder layer's ``forward`` returns.

    Attributes:
        hidden_BSD: The layer's output hidden states [B, S, D].
        router_stats: The router statistics of an MoE layer, None for a dense layer.
    """

    hidden_BSD: Tensor
    router_stats: RouterStats | None = None


# Registered as pytree nodes so module hooks that walk outputs (FSDP2's pre-backward
# hooks, activation checkpointing) find the tensors inside.
torch.export.register_dataclass(RouterStats)
torch.export.register_dataclass(LayerOutput)


@runtime_checkable
class Dispatcher(Protocol):
    """Moves routed tokens to their experts and expert outputs back to their tokens."""

    def dispatch(self, routed: Routed) -> tuple[Tensor, Tensor, Any]:
        """Sends each token to its top-k experts.

        Args:
            routed: The output of ``attend`` (needs ``hidden_TD``, ``topk_ids_TK``).

        Returns:
            ``(tokens_RD, tokens_per_expert_E, handle)``: rows grouped by local expert, the
            row count of each local expert, and what ``combine`` needs to undo the move.
        """
        ...

    def combine(self, expert_out_RD: Tensor, handle: Any) -> Tensor:
        """Weights expert outputs by the top-k weights and sums them per token.

        Args:
            expert_out_RD: Expert outputs in the order ``dispatch`` produced.
            handle: The handle ``dispatch`` returned.

        Returns:
            ``out_TD``: per-token weighted sum of its experts' outputs [T, D].
        """
        ...


@runtime_checkable
class MoEDecoderLayer(Protocol):
    """A decoder layer split into phases (see the module docstring)."""

    dispatcher: Dispatcher | None

    def attend(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> Routed:
        """Norm, self-attention, residual, norm, router (and shared experts).

        Args:
            x_BSD: Layer input [B, S, D].
            position_ids: Token positions [S] or [B, S] (RoPE); None for ``arange(S)``.

        Returns:
            The :class:`Routed` record.
        """
        ...

    def experts(self, tokens_RD: Tensor, tokens_per_expert_E: Tensor | None) -> Tensor:
        """Runs the (local) experts over their rows.

        Args:
            tokens_RD: Rows grouped by expert.
            tokens_per_expert_E: Rows per expert (None for a dense layer).

        Returns:
            Expert outputs, one row per input row.
        """
        ...

    def aggregate(self, expert_out_TD: Tensor, routed: Routed) -> Tensor:
        """Adds the shared-expert output and the residual; restores [B, S, D].

        Args:
            expert_out_TD: Per-token combined expert output [T, D].
            routed: The record from ``attend``.

        Returns:
            The layer output [B, S, D].
        """
        ...

    def forward(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> LayerOutput:
        """Composes the phases through ``dispatcher``.

        Args:
            x_BSD: Layer input [B, S, D].
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            The :class:`LayerOutput`.
        """
        ...
