"""Top-k routers of the three families, and their summable statistics.

Legend: B batch, S sequence, T tokens (B·S), D model dim, E experts, K top-k, N groups.

One module covers the variants (logits always in fp32, autocast off):

- ``softmax`` scoring (Qwen3-MoE, DeepSeek-V2): probabilities over all E, top-k of them,
  optionally renormalized (``norm_topk_prob``); DeepSeek's group-limited greedy keeps only
  the ``topk_group`` groups with the best member (``n_group`` groups of E/N experts) and
  multiplies the weights by ``routed_scaling_factor``.
- ``softmax_topk`` (GPT-OSS): top-k over the logits (router with a bias), then a softmax
  over the K chosen logits.
- ``sigmoid`` scoring with an aux-loss-free expert bias (DeepSeek-V3's
  ``e_score_correction_bias``): the bias shifts which experts are chosen, not their
  weights; groups are ranked by the sum of their two best biased scores. Update the bias
  from outside with :meth:`TopKRouter.update_expert_bias`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt_models.protocol import RouterStats

SCORING_FUNCS = ("softmax", "softmax_topk", "sigmoid")


@dataclass(frozen=True)
class RouterOutput:
    """The router's decision for T tokens.

    Attributes:
        topk_ids_TK: Chosen experts, int64 [T, K].
        topk_weights_TK: Their weights, fp32 [T, K].
        stats: Statistics for the load-balancing and z losses.
    """

    topk_ids_TK: Tensor
    topk_weights_TK: Tensor
    stats: RouterStats


class TopKRouter(nn.Module):
    """Linear scores ``weight`` [E, D] (+ ``bias`` [E]) and a top-k choice of experts.

    Args:
        hidden_size: D.
        num_experts: E.
        topk: K.
        scoring_func: ``"softmax"``, ``"softmax_topk"`` or ``"sigmoid"`` (module docstring).
        norm_topk_prob: Renormalize the K chosen weights to sum to one.
        bias: A bias on the router logits (GPT-OSS).
        n_group: N expert groups for group-limited routing, or None.
        topk_group: Groups kept per token when ``n_group`` is set.
        routed_scaling_factor: Multiplier of the final weights.
        expert_bias: Hold ``e_score_correction_bias`` [E] (aux-loss-free balancing).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        scoring_func: str = "softmax",
        norm_topk_prob: bool = False,
        bias: bool = False,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        expert_bias: bool = False,
    ):
        super().__init__()
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func ({scoring_func!r}) must be one of {SCORING_FUNCS}")
        if n_group is not None and (num_experts % n_group or not 1 <= (topk_group or 0) <= n_group):
            raise ValueError(
                f"n_group ({n_group}) must divide num_experts ({num_experts}) and topk_group "
                f"({topk_group}) be in [1, n_group]; fix the group-limited routing config"
            )
        self.num_experts, self.topk, self.scoring_func = num_experts, topk, scoring_func
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if expert_bias else None
        )

    def _limit_groups(self, choice_TE: Tensor) -> Tensor:
        """Zeroes (softmax) or -inf's (sigmoid) the experts outside each token's best groups."""
        num_tokens = choice_TE.shape[0]
        grouped_TNX = choice_TE.view(num_tokens, self.n_group, self.num_experts // self.n_group)
        if self.scoring_func == "sigmoid":
            group_score_TN = grouped_TNX.topk(2, dim=-1).values.sum(-1)
        else:
            group_score_TN = grouped_TNX.amax(dim=-1)
        group_ids = torch.topk(group_score_TN, self.topk_group, dim=-1, sorted=False).indices
        keep_TN = torch.zeros_like(group_score_TN, dtype=torch.bool).scatter_(1, group_ids, True)
        keep_TE = keep_TN[:, :, None].expand_as(grouped_TNX).reshape(num_tokens, self.num_experts)
        fill = float("-inf") if self.scoring_func == "sigmoid" else 0.0
        return choice_TE.masked_fill(~keep_TE, fill)

    def forward(self, hidden_TD: Tensor, batch_size: int = 1) -> RouterOutput:
        """Routes each token to K experts.

        Args:
            hidden_TD: Normed hidden states [T, D], sequence-major (T = B·S).
            batch_size: B, for the per-sequence statistics.

        Returns:
            The :class:`RouterOutput`.
        """
        with torch.autocast(hidden_TD.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            logits_TE = F.linear(hidden_TD.float(), self.weight.float(), bias)  # [T, E]
        probs_TE = torch.softmax(logits_TE, dim=-1)  # [T, E], for the balancing statistics
        if self.scoring_func == "softmax_topk":
            top_logits_TK, topk_ids_TK = torch.topk(logits_TE, self.topk, dim=-1)
            topk_weights_TK = torch.softmax(top_logits_TK, dim=-1)
        else:
            if self.scoring_func == "sigmoid":
                scores_TE = torch.sigmoid(logits_TE)
                probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
            else:
                scores_TE = probs_TE
            choice_TE = scores_TE.detach()
            if self.e_score_correction_bias is not None:
                choice_TE = choice_TE + self.e_score_correction_bias.float()
            if self.n_group is not None:
                choice_TE = self._limit_groups(choice_TE)
            topk_ids_TK = torch.topk(choice_TE, self.topk, dim=-1).indices  # [T, K]
            topk_weights_TK = scores_TE.gather(1, topk_ids_TK)  # [T, K]
            if self.norm_topk_prob:
                topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
            topk_weights_TK = topk_weights_TK * self.routed_scaling_factor
        return RouterOutput(
            topk_ids_TK, topk_weights_TK, _stats(logits_TE, probs_TE, topk_ids_TK, batch_size)
        )

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: Tensor, rate: float) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts by ``rate``,
        lower it for over-loaded ones (DeepSeek-V3 §2.1.2).

        Args:
            tokens_per_expert_E: Expert loads of the step, summed over all ranks [E].
            rate: The bias update speed ``u``.
        """
        if self.e_score_correction_bias is None:
            raise ValueError("update_expert_bias needs a router built with expert_bias=True")
        load_E = tokens_per_expert_E.float()
        self.e_score_correction_bias.add_(rate * torch.sign(load_E.mean() - load_E))


def _stats(logits_TE: Tensor, probs_TE: Tensor, topk_ids_TK: Tensor, batch: int) -> RouterStats:
    num_tokens, num_experts = probs_TE.shape
    chosen_TE = torch.zeros_like(probs_TE).scatter_(1, topk_ids_TK.detach(), 1.0)  # [T, E]
    seq_len = num_tokens // batch if batch else 0
    chosen_BSE = chosen_TE.view(batch, seq_len, num_experts)
    probs_BSE = probs_TE.view(batch, seq_len, num_experts)
    return RouterStats(
        tokens_per_expert_E=chosen_TE.sum(0),
        prob_sum_E=probs_TE.sum(0),
        num_tokens=torch.tensor(num_tokens, device=probs_TE.device),
        z_sum=torch.logsumexp(logits_TE, dim=-1).square().sum(),
        tokens_per_expert_BE=chosen_BSE.sum(1),
        prob_sum_BE=probs_BSE.sum(1),
        num_tokens_B=torch.full((batch,), seq_len, device=probs_TE.device),
    )


def load_balancing_loss(stats: RouterStats) -> Tensor:
    """Switch-Transformer load-balancing loss of one layer over the whole batch (HF's scale).

    ``E · Σ_e f_e · P_e`` with ``f_e = tokens_per_expert_e / T`` (the fraction of tokens
    that chose e; sums to K) and ``P_e = prob_sum_e / T`` (the mean router probability of
    e). It is K when routing is uniform (Fedus et al. 2021, eq. 4; HF's
    ``load_balancing_loss_func``). Pass statistics summed across ranks to get the loss of
    the global batch. The coefficient (``router_aux_loss_coef``) is not applied here.

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


def sequence_load_balancing_loss(stats: RouterStats) -> Tensor:
    """The same loss per sequence, averaged over sequences (DeepSeek's sequence-wise loss).

    Args:
        stats: Router statistics of one layer (per-sequence fields possibly summed over
            the context-parallel ranks of the same sequences).

    Returns:
        fp32 scalar.
    """
    num_experts = stats.prob_sum_BE.shape[-1]
    num_tokens_B1 = stats.num_tokens_B.clamp_min(1).float()[:, None]
    fraction_BE = stats.tokens_per_expert_BE / num_tokens_B1
    mean_prob_BE = stats.prob_sum_BE / num_tokens_B1
    loss_B = num_experts * (fraction_BE * mean_prob_BE).sum(-1)
    return loss_B.sum() / max(loss_B.numel(), 1)  # 0, not NaN, for an empty batch


def router_z_loss(stats: RouterStats) -> Tensor:
    """Router z-loss: mean over tokens of ``logsumexp(logits)²`` (ST-MoE, Zoph et al. 2022).

    Args:
        stats: Router statistics of one layer (possibly summed across ranks).

    Returns:
        fp32 scalar.
    """
    return stats.z_sum / stats.num_tokens.clamp_min(1).float()
