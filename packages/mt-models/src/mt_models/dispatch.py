"""The single-device dispatcher: permute tokens by expert with mt-ops, weight and sum back.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (R = T·K).

mt-parallel replaces it with an expert-parallel dispatcher of the same two methods.
"""

from dataclasses import dataclass

from torch import Tensor

from mt_models.protocol import Routed
from mt_ops import DispatchPlan, permute, plan_dispatch, unpermute


@dataclass(frozen=True)
class LocalDispatchHandle:
    """What :meth:`LocalDispatcher.combine` needs to bring rows back to tokens.

    Attributes:
        plan: The routing plan (row order, counts).
        topk_weights_TK: Router weights of each token's choices [T, K].
    """

    plan: DispatchPlan
    topk_weights_TK: Tensor


class LocalDispatcher:
    """Dispatches to all E experts on this device.

    Args:
        num_experts: E, the number of experts of the layer.
    """

    def __init__(self, num_experts: int):
        if num_experts < 1:
            raise ValueError(f"num_experts ({num_experts}) must be >= 1 for a dispatcher")
        self.num_experts = num_experts

    def dispatch(self, routed: Routed) -> tuple[Tensor, Tensor, LocalDispatchHandle]:
        """Groups each token's K copies by expert.

        Args:
            routed: The output of ``attend`` of an MoE layer.

        Returns:
            ``(tokens_RD, tokens_per_expert_E, handle)``.
        """
        assert routed.topk_ids_TK is not None and routed.topk_weights_TK is not None, (
            "dispatch needs an MoE layer's Routed (topk_ids_TK and topk_weights_TK set)"
        )
        plan = plan_dispatch(routed.topk_ids_TK, self.num_experts)
        tokens_RD = permute(routed.hidden_TD, plan)  # [R, D]
        return (
            tokens_RD,
            plan.tokens_per_expert_E,
            LocalDispatchHandle(plan, routed.topk_weights_TK),
        )

    def combine(self, expert_out_RD: Tensor, handle: LocalDispatchHandle) -> Tensor:
        """Weights each row by its top-k weight and sums the K rows of every token.

        Args:
            expert_out_RD: Expert outputs in dispatch order [R, D].
            handle: The handle from :meth:`dispatch`.

        Returns:
            ``out_TD`` [T, D].
        """
        return unpermute(expert_out_RD, handle.plan, handle.topk_weights_TK)
