"""Grouped SwiGLU experts with stacked weights, and the MoE block that holds them.

Legend: R routed rows, D model dim, F expert hidden dim, E experts (on this module).
"""

from torch import Tensor, nn

from mt_models.layers.router import TopKRouter
from mt_ops import GroupedLinear, swiglu

EXPERT_WEIGHT_NAMES = ("gate_proj", "up_proj", "down_proj")


class GroupedExperts(nn.Module):
    """E SwiGLU experts; each projection is an mt_ops.GroupedLinear ([E, out, in] weights).

    ``first_expert_id`` is the global id of expert 0 of this module (0 unless expert
    parallelism gave it a slice); canonical names use global ids.

    Args:
        num_experts: E, experts held by this module.
        hidden_size: D.
        intermediate_size: F (``moe_intermediate_size``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert_id = 0
        self.gate_proj = GroupedLinear(num_experts, hidden_size, intermediate_size)
        self.up_proj = GroupedLinear(num_experts, hidden_size, intermediate_size)
        self.down_proj = GroupedLinear(num_experts, intermediate_size, hidden_size)

    def forward(self, tokens_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Runs every expert over its consecutive rows.

        Args:
            tokens_RD: Rows grouped by expert, in expert order [R, D].
            tokens_per_expert_E: Rows per expert [E], summing to R.

        Returns:
            Expert outputs [R, D].
        """
        gate_RF = self.gate_proj(tokens_RD, tokens_per_expert_E)  # [R, F]
        up_RF = self.up_proj(tokens_RD, tokens_per_expert_E)  # [R, F]
        return self.down_proj(swiglu(gate_RF, up_RF), tokens_per_expert_E)  # [R, D]


class MoEBlock(nn.Module):
    """Holds the router (``gate``) and the ``experts``, named as Hugging Face's MoE block.

    The decoder layer drives the phases; this module only groups the parameters so that
    their names are ``mlp.gate.weight`` and ``mlp.experts.*``.

    Args:
        hidden_size: D.
        num_experts: E.
        topk: K.
        intermediate_size: F.
        norm_topk_prob: Renormalize the top-k weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        intermediate_size: int,
        norm_topk_prob: bool,
    ):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, topk, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size)
