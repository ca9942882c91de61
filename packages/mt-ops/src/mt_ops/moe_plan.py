"""MoE routing plan: sort the (token, expert) slots by expert, count per expert and EP rank.

Legend: T tokens, E experts, K top-k, R routed rows (R = T·K), P expert-parallel ranks,
B token blocks (of ``_PLAN_TOKENS`` tokens).

Each token picks K experts; slot ``t·K + k`` is its k-th pick. Grouped GEMMs need the slots
sorted by expert (stable: token order within an expert), plus per-expert counts; expert
parallelism also needs, per EP rank (experts ``[p·E/P, (p+1)·E/P)``), how many *tokens*
go there: a token is sent once to each rank that owns any of its experts.

Eager PyTorch plans with about twenty small ops (bincount, stable argsort, an inverse
scatter, a floor-divide, and for the ranks a one-hot, any(), sum and nonzero), each a launch
and a pass over memory, and the sort is device-wide. Here it is a counting sort in
three kernels:

1. ``_plan_count_kernel``: per block of tokens, the per-expert histogram of its slots
   (an [E, B] table, no atomics) and, per token, the set of ranks it goes to
   (deduplicated) with per-block rank counts.
2. ``_plan_scan_kernel`` (one program per expert, one for the ranks): each (expert,
   block)'s count of rows in earlier blocks, the per-expert and per-rank totals.
3. ``_plan_scatter_kernel``: each slot's row = rows of earlier experts + its expert's rows in
   earlier blocks + earlier slots of the same expert in its block; writes the sort
   permutation, its inverse and the source token of every row.

The result equals the stable argsort exactly (tests check it against the reference).
On CUDA the expert ids are not range-checked (that would need a host sync).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mt_ops._dtypes import is_integer
from mt_ops._triton import cdiv, launch, tl, triton, use_kernels

__all__ = ["DispatchPlan", "plan_dispatch", "plan_dispatch_reference"]


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
        tokens_per_rank_P: With ``num_ranks``: tokens each EP rank receives, counting a token
            once per rank however many of that rank's experts it picked; int64 [P]. Rank p
            owns experts ``[p·E/P, (p+1)·E/P)``. None without ``num_ranks``.
        token_to_rank_TP: With ``num_ranks``: bool [T, P], whether token t goes to rank p
            (the deduplicated send mask; ``tokens_per_rank_P`` is its column sum). None
            without ``num_ranks``.
    """

    tokens_per_expert_E: Tensor
    sorted_token_ids_R: Tensor
    sorted_slot_R: Tensor
    row_of_slot_R: Tensor
    num_tokens: int
    topk: int
    tokens_per_rank_P: Tensor | None = None
    token_to_rank_TP: Tensor | None = None


def _check(topk_ids_TK: Tensor, num_experts: int, num_ranks: int | None) -> None:
    if topk_ids_TK.dim() != 2:
        raise ValueError(
            f"topk_ids shape ({tuple(topk_ids_TK.shape)}) must be [T, K]; flatten batch "
            "and sequence into T"
        )
    dtype = topk_ids_TK.dtype
    if not is_integer(dtype):
        raise ValueError(
            f"topk_ids dtype ({dtype}) must be an integer type; pass the router's "
            "top-k indices, not its weights"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts ({num_experts}) must be >= 1")
    if num_ranks is not None and (num_ranks < 1 or num_experts % num_ranks):
        raise ValueError(
            f"num_ranks ({num_ranks}) must divide num_experts ({num_experts}); each EP rank "
            "owns an equal slice of experts"
        )


# 16 tokens × K slots per program (128 slots for K = 8): 16k tokens make 1024 programs.
# The histogram is tl.histogram over the block's slots (masked slots land in bin E, which is
# dropped); the rank dedup is a [16, K, P] compare; the within-block rank a 128 × 128 compare.
_PLAN_TOKENS = 16
# Warps of the three kernels, from ``bench_ops_moe.py --sweep`` on the H200 (16k tokens, top-8
# of 128, 8 ranks; GPU time of the three): 1 and 1 warps 17.4 us, the earlier 4 and 8 warps
# 43.7 us (the scatter alone 10.8 against 35.0); 8 or 32 tokens per program: 18.1 and 95 us.
PLAN_CONFIG = {"count_warps": 1, "scan_warps": 4, "scatter_warps": 1}


@triton.jit
def _plan_count_kernel(
    ids_ptr, expert_hist_ptr, rank_mask_ptr, rank_hist_ptr,
    num_tokens, topk, num_experts, experts_per_rank, num_ranks, num_blocks,
    HAS_RANKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr, BINS: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_S)
    slots = b * BLOCK_T * topk + lanes
    slot_ok = (lanes < BLOCK_T * topk) & (slots < num_tokens * topk)
    ids = tl.load(ids_ptr + slots, mask=slot_ok, other=0).to(tl.int32)
    ids = tl.where(slot_ok, ids, num_experts)  # masked slots go to the dropped bin E
    hist = tl.histogram(ids, BINS)  # [BINS]
    experts = tl.arange(0, BINS)
    # Stored expert-major ([E, B]) so that the scan reads each expert's column contiguously.
    tl.store(expert_hist_ptr + experts.to(tl.int64) * num_blocks + b, hist,
             mask=experts < num_experts)  # fmt: skip
    if HAS_RANKS:
        tokens = b * BLOCK_T + tl.arange(0, BLOCK_T)
        ks = tl.arange(0, BLOCK_K)
        ok = (tokens < num_tokens)[:, None] & (ks < topk)[None, :]
        ids_2d = tl.load(ids_ptr + tokens[:, None].to(tl.int64) * topk + ks[None, :], mask=ok,
                         other=-1).to(tl.int32)  # fmt: skip
        ranks = tl.arange(0, BLOCK_P)
        rank_of = tl.where(ids_2d >= 0, ids_2d // experts_per_rank, -1)  # [BT, BK]
        hits = (rank_of[:, :, None] == ranks[None, None, :]).to(tl.int32)  # [BT, BK, BP]
        goes = tl.max(hits, axis=1)  # [BT, BP]: token goes to rank (deduplicated)
        t_ok = tokens < num_tokens
        p_ok = ranks < num_ranks
        mask_offs = tokens[:, None].to(tl.int64) * num_ranks + ranks[None, :]
        tl.store(rank_mask_ptr + mask_offs, goes.to(tl.int8), mask=t_ok[:, None] & p_ok[None, :])
        rank_hist = tl.sum(goes, axis=0)  # [BP]
        tl.store(rank_hist_ptr + b.to(tl.int64) * num_ranks + ranks, rank_hist, mask=p_ok)


# One program per expert scans its column of block counts, 1024 blocks a step; one more
# program sums the rank counts.
_SCAN_BLOCKS = 1024


@triton.jit
def _plan_scan_kernel(
    expert_hist_ptr, rank_hist_ptr, block_base_ptr, tokens_per_expert_ptr,
    tokens_per_rank_ptr, num_blocks, num_experts, num_ranks,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    if e < num_experts:
        carry = tl.zeros((), dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            ok = blocks < num_blocks
            offs = e.to(tl.int64) * num_blocks + blocks
            hist = tl.load(expert_hist_ptr + offs, mask=ok, other=0)
            tl.store(block_base_ptr + offs, tl.cumsum(hist, axis=0) - hist + carry, mask=ok)
            carry += tl.sum(hist, axis=0)
        tl.store(tokens_per_expert_ptr + e, carry.to(tl.int64))
    else:
        ranks = tl.arange(0, BLOCK_P)
        p_ok = ranks < num_ranks
        total = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            ok = (blocks < num_blocks)[:, None] & p_ok[None, :]
            offs = blocks[:, None].to(tl.int64) * num_ranks + ranks[None, :]
            total += tl.sum(tl.load(rank_hist_ptr + offs, mask=ok, other=0), axis=0)
        tl.store(tokens_per_rank_ptr + ranks, total.to(tl.int64), mask=p_ok)


@triton.jit
def _plan_scatter_kernel(
    ids_ptr, base_ptr, tokens_per_expert_ptr, sorted_slot_ptr, row_of_slot_ptr,
    sorted_token_ptr, num_slots, topk, num_experts, num_blocks, slots_per_block,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_S)
    slots = b * slots_per_block + lanes
    ok = (lanes < slots_per_block) & (slots < num_slots)
    ids = tl.load(ids_ptr + slots, mask=ok, other=-1).to(tl.int32)
    earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank_in_block = tl.sum(earlier.to(tl.int32), axis=1)  # [BS]
    # Rows of all experts before this slot's expert: Σ_e count[e]·[e < id].
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(tokens_per_expert_ptr + experts, mask=experts < num_experts, other=0)
    counts = counts.to(tl.int32)
    expert_start = tl.sum(tl.where(experts[None, :] < ids[:, None], counts[None, :], 0), axis=1)
    base = tl.load(base_ptr + ids.to(tl.int64) * num_blocks + b, mask=ok, other=0)
    rows = expert_start + base + rank_in_block
    tl.store(sorted_slot_ptr + rows, slots.to(tl.int64), mask=ok)
    tl.store(sorted_token_ptr + rows, (slots // topk).to(tl.int64), mask=ok)
    tl.store(row_of_slot_ptr + slots, rows.to(tl.int64), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round2(n: int) -> int:
    return n + n % 2


def _plan_kernels(topk_ids_TK: Tensor, num_experts: int, num_ranks: int | None) -> DispatchPlan:
    num_tokens, topk = topk_ids_TK.shape
    dev = topk_ids_TK.device
    ids = topk_ids_TK.contiguous()
    num_blocks = cdiv(num_tokens, _PLAN_TOKENS)
    has_ranks = num_ranks is not None
    num_p = num_ranks or 1
    # Two allocations (int32 counts, int64 results) instead of eight: at 16k tokens the
    # plan's GPU work is ~45 us on the H200, so host time per call counts.
    num_eb, num_bp = num_experts * num_blocks, num_blocks * num_p if has_ranks else 0
    counts32 = torch.empty(2 * num_eb + num_bp, dtype=torch.int32, device=dev)
    expert_hist_EB, block_base_EB = counts32[: 2 * num_eb].view(2, num_experts, num_blocks)
    rank_hist_BP = counts32[2 * num_eb :].view(num_bp // num_p, num_p)
    rank_mask_TP = torch.empty(num_tokens if has_ranks else 0, num_p, dtype=torch.int8, device=dev)
    num_slots = num_tokens * topk
    head, stride = _round2(num_experts + num_p), _round2(num_slots)  # 16-byte aligned parts
    results64 = torch.empty(head + 3 * stride, dtype=torch.int64, device=dev)
    tokens_per_expert_E = results64[:num_experts]
    tokens_per_rank_P = results64[num_experts : num_experts + num_p]
    sorted_slot_R, sorted_token_R, row_of_slot_R = results64[head:].view(3, stride)[:, :num_slots]
    block_slots = _PLAN_TOKENS * topk
    launch(
        _plan_count_kernel, (num_blocks,), ids, expert_hist_EB, rank_mask_TP, rank_hist_BP,
        num_tokens, topk, num_experts, num_experts // num_p, num_p, num_blocks,
        HAS_RANKS=has_ranks, BLOCK_T=_PLAN_TOKENS, BLOCK_K=_pow2(topk),
        BLOCK_S=_pow2(block_slots), BINS=_pow2(num_experts + 1), BLOCK_P=_pow2(num_p),
        num_warps=PLAN_CONFIG["count_warps"],
    )  # fmt: skip
    # Each (expert, block)'s rows in earlier blocks, and each expert's total.
    launch(
        _plan_scan_kernel, (num_experts + int(has_ranks),), expert_hist_EB, rank_hist_BP,
        block_base_EB, tokens_per_expert_E, tokens_per_rank_P, num_blocks, num_experts, num_p,
        BLOCK_B=_SCAN_BLOCKS, BLOCK_P=_pow2(num_p),
        num_warps=PLAN_CONFIG["scan_warps"],
    )  # fmt: skip
    launch(
        _plan_scatter_kernel, (num_blocks,), ids.view(-1), block_base_EB, tokens_per_expert_E,
        sorted_slot_R, row_of_slot_R, sorted_token_R, num_slots, topk, num_experts, num_blocks,
        block_slots, BLOCK_S=_pow2(block_slots), BLOCK_E=_pow2(num_experts),
        num_warps=PLAN_CONFIG["scatter_warps"],
    )  # fmt: skip
    if num_blocks == 0:
        tokens_per_expert_E.zero_()
        tokens_per_rank_P.zero_()
    return DispatchPlan(
        tokens_per_expert_E=tokens_per_expert_E,
        sorted_token_ids_R=sorted_token_R,
        sorted_slot_R=sorted_slot_R,
        row_of_slot_R=row_of_slot_R,
        num_tokens=num_tokens,
        topk=topk,
        tokens_per_rank_P=tokens_per_rank_P if has_ranks else None,
        token_to_rank_TP=rank_mask_TP.view(torch.bool) if has_ranks else None,
    )


def _kernels_apply(topk_ids_TK: Tensor) -> bool:
    return 0 < topk_ids_TK.shape[1] <= 16  # the in-block compare is (16·K)² lanes


def plan_dispatch(
    topk_ids_TK: Tensor, num_experts: int, *, num_ranks: int | None = None
) -> DispatchPlan:
    """Sort the T·K (token, expert) slots by expert; optionally count tokens per EP rank.

    Args:
        topk_ids_TK: Expert id of each token's k-th choice, integer [T, K], values in
            [0, num_experts).
        num_experts: E, the number of experts (the length of ``tokens_per_expert_E``).
        num_ranks: P, expert-parallel ranks owning equal consecutive expert slices; when
            given, the plan also holds ``tokens_per_rank_P`` and ``token_to_rank_TP``.

    Returns:
        The :class:`DispatchPlan`; experts that receive no token have a count of zero.
    """
    _check(topk_ids_TK, num_experts, num_ranks)
    if use_kernels(topk_ids_TK) and _kernels_apply(topk_ids_TK):
        return _plan_kernels(topk_ids_TK, num_experts, num_ranks)
    return plan_dispatch_reference(topk_ids_TK, num_experts, num_ranks=num_ranks)


def _run_plan_kernels_for_test(topk_ids_TK, num_experts, num_ranks=None) -> DispatchPlan:
    """The kernel path on any device (Triton's interpreter on CPU); tests use it."""
    _check(topk_ids_TK, num_experts, num_ranks)
    return _plan_kernels(topk_ids_TK, num_experts, num_ranks)


def plan_dispatch_reference(
    topk_ids_TK: Tensor, num_experts: int, *, num_ranks: int | None = None
) -> DispatchPlan:
    """Eager reference of :func:`plan_dispatch`: bincount, stable argsort, one-hot ranks."""
    _check(topk_ids_TK, num_experts, num_ranks)
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
    row_of_slot_R[sorted_slot_R] = torch.arange(sorted_slot_R.numel(), device=ids_R.device)
    tokens_per_rank_P = token_to_rank_TP = None
    if num_ranks is not None:
        rank_TK = topk_ids_TK.long() // (num_experts // num_ranks)  # [T, K]
        token_to_rank_TP = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=ids_R.device)
        token_to_rank_TP.scatter_(1, rank_TK, True)  # dedup: a set per token
        tokens_per_rank_P = token_to_rank_TP.sum(0)  # [P] int64
    return DispatchPlan(
        tokens_per_expert_E=tokens_per_expert_E,
        sorted_token_ids_R=sorted_slot_R // topk if topk else sorted_slot_R,
        sorted_slot_R=sorted_slot_R,
        row_of_slot_R=row_of_slot_R,
        num_tokens=num_tokens,
        topk=topk,
        tokens_per_rank_P=tokens_per_rank_P,
        token_to_rank_TP=token_to_rank_TP,
    )
