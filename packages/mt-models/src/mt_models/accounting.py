"""FLOP and parameter accounting of a causal LM, read off its modules (ARCHITECTURE §8).

A matmul weight is a ``weight`` of two or more dims other than the embedding table (the
experts' 2-D ``bias`` [E, O] is not one); it
costs 2 FLOPs per element per token in the forward when active. Experts are active K of
E times per token; everything else always. Attention scores add each layer's
``self_attn.score_flops_per_token(S)``. Training is 3 × forward. Experts are counted over
the router's E, so a model under expert parallelism (each rank holding E/ep experts)
counts as the whole model.
"""

from dataclasses import dataclass

from torch import nn

from mt_models.layers.experts import MoEBlock


@dataclass(frozen=True)
class FlopsAndParams:
    """Counts of one model at one sequence length.

    Attributes:
        total_params: Every parameter (embedding and head included).
        active_params: Parameters one token uses (K of E experts).
        forward_matmul_flops: 2 × active matmul weights (head included), per token.
        forward_attention_flops: Attention scores over all layers, per token.
    """

    total_params: int
    active_params: int
    forward_matmul_flops: float
    forward_attention_flops: float

    @property
    def train_flops_per_token(self) -> float:
        """3 × (matmul + attention) forward FLOPs."""
        return 3.0 * (self.forward_matmul_flops + self.forward_attention_flops)

    @classmethod
    def of(cls, model: nn.Module, seq_len: int) -> "FlopsAndParams":
        """Counts a :class:`~mt_models.base.CausalLM`.

        Args:
            model: The model (``model.model.layers``, ``output_weight``).
            seq_len: S.

        Returns:
            The counts.
        """
        total = sum(p.numel() for p in model.parameters())  # + other ranks' experts below
        inactive = 0.0
        matmul = float(model.output_weight.numel())  # head (the embedding when tied)
        attention = 0.0
        for layer in model.model.layers:
            matmul += _matmul_params(layer.self_attn)
            attention += layer.self_attn.score_flops_per_token(seq_len)
            mlp = layer.mlp
            if isinstance(mlp, MoEBlock):
                # Per expert, counted over the router's E experts: under expert parallelism
                # this rank's module holds only e = E/ep of them.
                experts, router = mlp.experts, mlp.topk_router
                held = experts.num_experts
                per_expert = sum(p.numel() for p in experts.parameters()) / held
                total += round(per_expert * (router.num_experts - held))
                inactive += per_expert * (router.num_experts - router.topk)
                matmul += _matmul_params(experts) / held * router.topk
                matmul += mlp.topk_router.weight.numel()
                if mlp.shared_experts is not None:
                    matmul += _matmul_params(mlp.shared_experts)
            else:
                matmul += _matmul_params(mlp)
        return cls(total, round(total - inactive), 2.0 * matmul, attention)


def _matmul_params(module: nn.Module) -> int:
    return sum(
        p.numel() for n, p in module.named_parameters() if n.endswith("weight") and p.dim() >= 2
    )
