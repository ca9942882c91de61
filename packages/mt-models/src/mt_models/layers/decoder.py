"""A pre-norm decoder layer implementing the five-phase protocol (see ``protocol.py``).

Legend: B batch, S sequence, T tokens (B·S), D model dim, E experts, K top-k, R routed rows.
"""

from torch import Tensor, nn

from mt_models.dispatch import LocalDispatcher
from mt_models.layers.experts import MoEBlock
from mt_models.protocol import Dispatcher, LayerOutput, Routed


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``h + mlp(norm(h))``, where ``mlp`` is MoE or dense.

    Families assemble it from shared modules; the attribute names are Hugging Face's
    (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``).

    Args:
        self_attn: Attention module called as ``self_attn(x_BSD, position_ids)`` (it owns
            its RoPE and its ``attention_core``).
        mlp: A :class:`MoEBlock` (sparse layer) or a dense MLP module.
        input_layernorm: Norm before attention.
        post_attention_layernorm: Norm before the MLP / router.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
    ):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoEBlock)
        # Swapped by mt-parallel for an expert-parallel dispatcher.
        self.dispatcher: Dispatcher | None = (
            LocalDispatcher(mlp.experts.num_experts) if self.is_moe else None
        )

    def attend(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> Routed:
        """Norm, causal attention, residual, norm, and (MoE layers) the router and shared
        experts.

        Args:
            x_BSD: Layer input [B, S, D].
            position_ids: Token positions [S] or [B, S] (set RoPE); None for ``arange(S)``.

        Returns:
            The :class:`Routed` record; dense layers leave the top-k fields None.
        """
        batch, seq_len, dim = x_BSD.shape
        h_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), position_ids)
        residual_TD = h_BSD.reshape(batch * seq_len, dim)  # [T, D]
        hidden_TD = self.post_attention_layernorm(residual_TD)  # [T, D]
        if not self.is_moe:
            return Routed(
                hidden_TD=hidden_TD, residual_TD=residual_TD, batch_shape=(batch, seq_len)
            )
        decision = self.mlp.topk_router(hidden_TD, batch)
        shared = self.mlp.shared_experts
        return Routed(
            hidden_TD=hidden_TD,
            residual_TD=residual_TD,
            batch_shape=(batch, seq_len),
            topk_ids_TK=decision.topk_ids_TK,
            topk_weights_TK=decision.topk_weights_TK,
            shared_out_TD=None if shared is None else shared(hidden_TD),
            router_stats=decision.stats,
        )

    def experts(self, tokens_RD: Tensor, tokens_per_expert_E: Tensor | None) -> Tensor:
        """Runs the experts over their rows (dense layers: the MLP over all tokens).

        Args:
            tokens_RD: Rows grouped by expert [R, D] (dense layers: ``hidden_TD``).
            tokens_per_expert_E: Rows per expert [E] (dense layers: None).

        Returns:
            One output row per input row.
        """
        if not self.is_moe:
            return self.mlp(tokens_RD)
        if tokens_per_expert_E is None:
            raise ValueError(
                "experts: tokens_per_expert_E is None, but this is an MoE layer: pass the "
                "counts its dispatcher's dispatch(routed) returns (only a dense layer takes None)"
            )
        return self.mlp.experts(tokens_RD, tokens_per_expert_E)

    def aggregate(self, expert_out_TD: Tensor, routed: Routed) -> Tensor:
        """Adds the shared-expert output (if any) and the residual, restores [B, S, D].

        Args:
            expert_out_TD: Per-token combined expert output [T, D].
            routed: The record from :meth:`attend`.

        Returns:
            Layer output [B, S, D].
        """
        out_TD = routed.residual_TD + expert_out_TD
        if routed.shared_out_TD is not None:
            out_TD = out_TD + routed.shared_out_TD
        return out_TD.view(*routed.batch_shape, out_TD.shape[-1])

    def forward(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> LayerOutput:
        """attend → dispatch → experts → combine → aggregate (dense: attend → experts → aggregate).

        Args:
            x_BSD: Layer input [B, S, D].
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            The :class:`LayerOutput` (hidden states and, for MoE layers, router statistics).
        """
        routed = self.attend(x_BSD, position_ids)
        if routed.topk_ids_TK is None:
            expert_out_TD = self.experts(routed.hidden_TD, None)
        else:
            assert self.dispatcher is not None, "an MoE layer needs a dispatcher"
            if isinstance(self.dispatcher, LocalDispatcher):  # may fuse the three phases
                expert_out_TD = self.dispatcher.run_experts(routed, self.mlp.experts)
            else:
                tokens_RD, tokens_per_expert_E, handle = self.dispatcher.dispatch(routed)
                expert_out_RD = self.experts(tokens_RD, tokens_per_expert_E)
                expert_out_TD = self.dispatcher.combine(expert_out_RD, handle)
        return LayerOutput(self.aggregate(expert_out_TD, routed), routed.router_stats)
