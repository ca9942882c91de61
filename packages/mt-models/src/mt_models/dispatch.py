"""The single-device dispatcher: permute tokens by expert with mt-ops, weight and sum back.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (R = T·K).

mt-parallel replaces it with an expert-parallel dispatcher of the same two methods. A layer
that runs its phases back to back calls :meth:`LocalDispatcher.run_experts` instead, which
hands experts with a ``forward_tokens`` method (:class:`~mt_models.layers.experts.
SwiGLUExperts`) the tokens and the plan, so FP8 experts can fuse permute and unpermute
into their quantization passes (``mt_ops.grouped_swiglu_moe``).
"""

from dataclasses import dataclass

from torch import Tensor, nn

from mt_models.protocol import Routed
from mt_ops import DispatchPlan, permute, plan_dispatch, unpermute


class LocalRoute:
    """The plan and router weights that :meth:`LocalDispatcher.run_experts` hands to
    ``experts.forward_tokens``.

    A plain object on purpose: FSDP2 casts the floating-point tensors it finds in a
    registered method's arguments (inside tuples, dicts and dataclasses too) to its
    ``param_dtype``; the fp32 router weights must stay fp32, as in :meth:`combine`.

    Attributes:
        plan: The routing plan over the experts module's experts.
        topk_weights_TK: Router weights of each token's choices [T, K].
    """

    __slots__ = ("plan", "topk_weights_TK")

    def __init__(self, plan: DispatchPlan, topk_weights_TK: Tensor):
        self.plan = plan
        self.topk_weights_TK = topk_weights_TK


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
        check_top_k(routed, "LocalDispatcher.dispatch")
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

    def run_experts(self, routed: Routed, experts: nn.Module) -> Tensor:
        """dispatch → experts → combine in one call, as ``experts.forward_tokens`` when the
        experts module has it (the permute and unpermute become its business).

        Args:
            routed: The output of ``attend`` of an MoE layer.
            experts: The layer's experts module (called as ``experts(tokens_RD, counts_E)``).

        Returns:
            ``out_TD`` [T, D], as ``combine(experts(*dispatch(routed)[:2]), handle)``.
        """
        forward_tokens = getattr(experts, "forward_tokens", None)
        if forward_tokens is None:
            tokens_RD, tokens_per_expert_E, handle = self.dispatch(routed)
            return self.combine(experts(tokens_RD, tokens_per_expert_E), handle)
        check_top_k(routed, "LocalDispatcher.run_experts")
        plan = plan_dispatch(routed.topk_ids_TK, self.num_experts)
        return forward_tokens(routed.hidden_TD, LocalRoute(plan, routed.topk_weights_TK))


def check_top_k(routed: Routed, caller: str) -> None:
    """Raises ValueError, naming `caller` (a dispatcher's method), unless `routed` is an MoE
    layer's attend output (top-k ids and weights set)."""
    ids_TK, weights_TK = routed.topk_ids_TK, routed.topk_weights_TK
    if ids_TK is None or weights_TK is None:
        given = (
            f"topk_ids_TK {'None' if ids_TK is None else 'set'}, "
            f"topk_weights_TK {'None' if weights_TK is None else 'set'}"
        )
        raise ValueError(
            f"{caller}: routed has no top-k ({given}): it is a dense "
            "layer's attend output, which skips dispatch (layer.experts(routed.hidden_TD, None))"
        )
