"""Softmax top-k router and the load-balancing loss.

Legend: T tokens, D model dim, E experts, K top-k.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt_models.protocol import RouterStats


@dataclass(frozen=True)
class RouterOutput:
    """The router's decision for T tokens.

    Attributes:
        topk_ids_TK: Chosen experts, int64 [T, K], in descending probability.
        topk_weights_TK: Their weights, fp32 [T, K].
        stats: Statistics for the load-balancing loss.
    """

    topk_ids_TK: Tensor
    topk_weights_TK: Tensor
    stats: RouterStats


class TopKRouter(nn.Module):
    """Linear scores, softmax over all experts in fp32, top-k (Qwen3-MoE / Mixtral).

    The parameter is named ``weight`` [E, D] so that the module placed at ``mlp.gate``
    has the Hugging Face key ``mlp.gate.weight``.

    Args:
        hidden_size: D.
        num_experts: E.
        topk: K.
        norm_topk_prob: Renormalize the K chosen probabilities to sum to one.
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.topk, self.norm_topk_prob = num_experts, topk, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, hidden_TD: Tensor) -> RouterOutput:
        """Routes each token to its K most probable experts.

        Args:
            hidden_TD: Normed hidden states [T, D].

        Returns:
            The :class:`RouterOutput`.
        """
        logits_TE = F.linear(hidden_TD, self.weight)  # [T, E], in the model dtype (as HF)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)  # [T, E]
        topk_weights_TK, topk_ids_TK = torch.topk(probs_TE, self.topk, dim=-1)  # [T, K]
        if self.norm_topk_prob:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        ids_flat = topk_ids_TK.detach().reshape(-1)
        stats = RouterStats(
            tokens_per_expert_E=torch.bincount(ids_flat, minlength=self.num_experts).float(),
            prob_sum_E=probs_TE.sum(dim=0),  # [E]
            num_tokens=torch.tensor(hidden_TD.shape[0], device=hidden_TD.device),
        )
        return RouterOutput(topk_ids_TK, topk_weights_TK, stats)


def load_balancing_loss(stats: RouterStats) -> Tensor:
    """Switch-Transformer load-balancing loss of one layer, Hugging Face Qwen3-MoE's scale.

    ``E · Σ_e f_e · P_e`` with ``f_e = tokens_per_expert_e / T`` (the fraction of tokens
    that chose e; sums to K) and ``P_e = prob_sum_e / T`` (the mean router probability of
    e). It is K when routing is uniform (Fedus et al. 2021, eq. 4; HF's
    ``load_balancing_loss_func``). Pass statistics summed across ranks to get the loss of
    the global micro-batch. The coefficient (``router_aux_loss_coef``) is not applied here.

    Args:
        stats: Router statistics of one layer (possibly summed across ranks).

    Returns:
        fp32 scalar; the gradient flows through ``prob_sum_E`` to the router.
    """
    num_experts = stats.prob_sum_E.shape[0]
    num_tokens = stats.num_tokens.clamp_min(1).float()
    fraction_E = stats.tokens_per_expert_E / num_tokens  # [E], sums to K
    mean_prob_E = stats.prob_sum_E / num_tokens  # [E], sums to 1
    return num_experts * (fraction_E * mean_prob_E).sum()
