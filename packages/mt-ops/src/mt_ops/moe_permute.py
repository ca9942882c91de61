"""MoE routing plan and token permutation (the single-device dispatch of tokens to experts).

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (R = T·K).

Each token picks K experts. To run experts as grouped GEMMs, the T·K (token, expert) pairs
("slots", flat index ``t·K + k``) are sorted by expert so that each expert's rows are
consecutive: ``permute`` gathers token rows into that order, ``unpermute`` brings expert
outputs back, weights them by the router's top-k weights and sums the K rows per token.

Eager PyTorch plans with bincount + a stable argsort (+ an inverse permutation), which is a
handful of small kernels and a device-wide sort; a fused kernel (later) builds counts,
prefix sums and the scatter index with a counting sort in one or two launches.
``unpermute`` here gathers with the inverse permutation and sums over K in a fixed order,
so it is deterministic on every device (no atomics), and accumulates in fp32.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DispatchPlan", "plan_dispatch", "permute", "unpermute"]


@dataclass(frozen=True)
class DispatchPlan:
    """Where each routed row comes from and goes back to.

    Attributes:
        tokens_per_expert_E: Rows per expert, int64 [E]; sums to T·K.
        sorted_token_ids_R: Token index of each routed row, rows grouped by expert in
            expert order, stable (token order) within an expert; int64 [R].
        sorted_slot_R: Flat slot ``t·K + k`` of each routed row; int64 [R].
        row_of_slot_R: Inverse of ``sorted_slot_R``: the routed row of each slot; int64 [R].
        num_tokens: T.
        topk: K.
    """

    tokens_per_expert_E: Tensor
    sorted_token_ids_R: Tensor
    sorted_slot_R: Tensor
    row_of_slot_R: Tensor
    num_tokens: int
    topk: int


def plan_dispatch(topk_ids_TK: Tensor, num_experts: int) -> DispatchPlan:
    """Sort the T·K (token, expert) slots by expert.

    Args:
        topk_ids_TK: Expert id of each token's k-th choice, integer [T, K], values in
            [0, num_experts).
        num_experts: E, the number of experts (the length of ``tokens_per_expert_E``).

    Returns:
        The :class:`DispatchPlan`; experts that receive no token have a count of zero.
    """
    if topk_ids_TK.dim() != 2:
        raise ValueError(
            f"topk_ids shape ({tuple(topk_ids_TK.shape)}) must be [T, K]; flatten batch "
            "and sequence into T"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts ({num_experts}) must be >= 1")
    num_tokens, topk = topk_ids_TK.shape
    ids_R = topk_ids_TK.reshape(-1).long()  # [T*K], slot order
    if ids_R.numel() and (int(ids_R.min()) < 0 or int(ids_R.max()) >= num_experts):
        raise ValueError(
            f"topk_ids values (min {int(ids_R.min())}, max {int(ids_R.max())}) must lie in "
            f"[0, num_experts={num_experts}); check the router's output size"
        )
    tokens_per_expert_E = torch.bincount(ids_R, minlength=num_experts)  # [E]
    sorted_slot_R = torch.argsort(ids_R, stable=True)  # [R]
    row_of_slot_R = torch.empty_like(sorted_slot_R)
    row_of_slot_R[sorted_slot_R] = torch.arange(
        sorted_slot_R.numel(), device=sorted_slot_R.device
    )  # [R]
    return DispatchPlan(
        tokens_per_expert_E=tokens_per_expert_E,
        sorted_token_ids_R=sorted_slot_R // topk if topk else sorted_slot_R,
        sorted_slot_R=sorted_slot_R,
        row_of_slot_R=row_of_slot_R,
        num_tokens=num_tokens,
        topk=topk,
    )


def permute(x_TD: Tensor, plan: DispatchPlan) -> Tensor:
    """Gather token rows into expert order (each token appears K times).

    Args:
        x_TD: Token activations [T, D].
        plan: The plan from :func:`plan_dispatch` for these T tokens.

    Returns:
        Routed rows [R, D], expert e's rows consecutive, in expert order.
    """
    if x_TD.dim() != 2 or x_TD.shape[0] != plan.num_tokens:
        raise ValueError(
            f"x shape ({tuple(x_TD.shape)}) must be [T={plan.num_tokens}, D]; pass the "
            "tokens the plan was made for"
        )
    return x_TD.index_select(0, plan.sorted_token_ids_R)  # [R, D]


def unpermute(y_RD: Tensor, plan: DispatchPlan, topk_weights_TK: Tensor) -> Tensor:
    """Weight each routed row by its top-k weight and sum the K rows of every token.

    Args:
        y_RD: Expert outputs [R, D] in the plan's row order.
        plan: The plan from :func:`plan_dispatch`.
        topk_weights_TK: Router weight of each token's k-th choice [T, K].

    Returns:
        ``out[t] = Σ_k w[t, k] · y[row of (t, k)]``, shape [T, D], dtype of ``y_RD``,
        summed in fp32.
    """
    num_tokens, topk = plan.num_tokens, plan.topk
    if y_RD.dim() != 2 or y_RD.shape[0] != num_tokens * topk:
        raise ValueError(
            f"y shape ({tuple(y_RD.shape)}) must be [R={num_tokens * topk}, D]; pass one "
            "output row per routed row"
        )
    if tuple(topk_weights_TK.shape) != (num_tokens, topk):
        raise ValueError(
            f"topk_weights shape ({tuple(topk_weights_TK.shape)}) must be "
            f"[T, K] = [{num_tokens}, {topk}]"
        )
    y_SD = y_RD.index_select(0, plan.row_of_slot_R)  # [T*K, D], slot order
    y_TKD = y_SD.view(num_tokens, topk, y_RD.shape[1])  # [T, K, D]
    weighted_TKD = y_TKD.float() * topk_weights_TK.float().unsqueeze(-1)  # [T, K, D]
    return weighted_TKD.sum(dim=1).to(y_RD.dtype)  # [T, D]
