"""Grouped experts with stacked weights, and the MoE block that holds router and experts.

Legend: R routed rows, D model dim, F expert hidden dim, E experts (on this module).

An experts module (a :class:`GroupedExperts`) holds one ``mt_ops.GroupedLinear`` per
projection and a ``first_expert_id`` (the global id of its expert 0; expert parallelism
gives each rank a slice). Canonical names split each GroupedLinear per global expert id:
``<experts>.<proj>.weight`` [E, O, I] → ``<experts>.{e}.<proj>.weight`` [O, I] (and
``.bias`` [E, O] → ``.bias`` [O]); see ``CausalLM.to_canonical``.
"""

from torch import Tensor, nn

from mt_models.dispatch import LocalRoute
from mt_models.layers.router import TopKRouter
from mt_ops import (
    GroupedLinear,
    clamped_swiglu_fused,
    grouped_swiglu_mlp,
    grouped_swiglu_moe,
)


class GroupedExperts(nn.Module):
    """Base of every experts module: E experts whose projections are ``GroupedLinear``
    children (every parameter has the experts in dim 0), and ``first_expert_id``.

    Expert parallelism finds experts modules by this class, slices dim 0 of their
    parameters and advances ``first_expert_id``.

    Args:
        num_experts: E, experts held by this module.
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert_id = 0

    def forward(self, tokens_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Runs every expert over its consecutive rows (``[R, D]`` → ``[R, D]``)."""
        raise NotImplementedError


class SwiGLUExperts(GroupedExperts):
    """E SwiGLU experts: ``down(silu(gate(x)) · up(x))`` (Qwen3-MoE, DeepSeek-V2).

    Args:
        num_experts: E, experts held by this module.
        hidden_size: D.
        intermediate_size: F (``moe_intermediate_size``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__(num_experts)
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
        # mt-ops composes the projections, or runs its fused FP8 MLP once they are FP8.
        return grouped_swiglu_mlp(
            tokens_RD, tokens_per_expert_E, self.gate_proj, self.up_proj, self.down_proj
        )  # [R, D]

    def forward_tokens(self, hidden_TD: Tensor, route: LocalRoute) -> Tensor:
        """permute → experts → weighted unpermute from the tokens (the local dispatcher's
        fused path); FP8 experts fold the permute and unpermute into their quantization.

        Args:
            hidden_TD: Token activations [T, D].
            route: The dispatch plan over this module's experts and the router weights.

        Returns:
            The weighted sum of each token's expert outputs [T, D].
        """
        return grouped_swiglu_moe(
            hidden_TD, route.plan, route.topk_weights_TK,
            self.gate_proj, self.up_proj, self.down_proj,
        )  # fmt: skip  # [T, D]


class ClampedSwiGLUExperts(GroupedExperts):
    """E GPT-OSS experts: fused interleaved ``gate_up_proj`` and ``down_proj``, both with
    biases, and the clamped SwiGLU ``(clamp(up) + 1) · g · sigmoid(alpha · g)``.

    ``gate_up_proj.weight`` [E, 2F, D] keeps the Hub's interleaving (gate rows at even,
    up rows at odd indices); the Hub stores it transposed ([E, D, 2F]). The activation is
    ``mt_ops.clamped_swiglu_fused`` (a Triton kernel on CUDA, the eager op elsewhere).

    Args:
        num_experts: E, experts held by this module.
        hidden_size: D.
        intermediate_size: F.
        alpha: ``swiglu_alpha``.
        limit: ``swiglu_limit``.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float
    ):
        super().__init__(num_experts)
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = GroupedLinear(
            num_experts, hidden_size, 2 * intermediate_size, bias=True
        )
        self.down_proj = GroupedLinear(num_experts, intermediate_size, hidden_size, bias=True)

    def forward(self, tokens_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Runs every expert over its consecutive rows.

        Args:
            tokens_RD: Rows grouped by expert, in expert order [R, D].
            tokens_per_expert_E: Rows per expert [E], summing to R.

        Returns:
            Expert outputs [R, D].
        """
        gate_up_R2F = self.gate_up_proj(tokens_RD, tokens_per_expert_E)  # [R, 2F]
        act_RF = clamped_swiglu_fused(gate_up_R2F, self.alpha, self.limit)  # [R, F]
        return self.down_proj(act_RF, tokens_per_expert_E)  # [R, D]


class MoEBlock(nn.Module):
    """Groups the router, the experts and optional shared experts under the Hub's names.

    The decoder layer drives the phases; this module only names the parameters:
    ``mlp.<router_name>.*`` (``gate`` for Qwen3/DeepSeek, ``router`` for GPT-OSS),
    ``mlp.experts.*`` and ``mlp.shared_experts.*``.

    Args:
        router: The :class:`TopKRouter`.
        experts: A :class:`GroupedExperts`.
        shared_experts: A dense MLP every token goes through, or None.
        router_name: Attribute (and Hub key) name of the router.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: nn.Module,
        shared_experts: nn.Module | None = None,
        router_name: str = "gate",
    ):
        super().__init__()
        self.router_name = router_name
        setattr(self, router_name, router)
        self.experts = experts
        self.shared_experts = shared_experts

    @property
    def topk_router(self) -> TopKRouter:
        """The router module, whatever its attribute name."""
        return getattr(self, self.router_name)
