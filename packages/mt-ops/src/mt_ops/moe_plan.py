"""MoE routing plan: sort the (token, expert) slots by expert, count per expert and EP rank.

Legend: T tokens, E experts, K top-k, R routed rows (R = T·K), P expert-parallel ranks.

Each token picks K experts; slot ``t·K + k`` is its k-th pick. Grouped GEMMs need the slots
sorted by expert (stable: token order within an expert), plus per-expert counts; expert
parallelism also needs, per EP rank (experts ``[p·E/P, (p+1)·E/P)``), how many *tokens*
go there: a token is sent once to each rank that owns any of its experts.

Eager PyTorch plans with about twenty small ops (bincount, stable argsort, an inverse
scatter, a floor-divide, and for the ranks a one-hot, any(), sum and nonzero), each a launch
and a pass over memory, and the sort is device-wide. Here it is one kernel launch
(``_plan_kernel``), a counting sort in two phases with a grid-wide barrier between them:

1. each program counts the slots of its contiguous range of tokens per expert and the
   ranks each of its tokens goes to (deduplicated), and publishes its counts;
2. each program reads the counts of all programs: the totals, and the rows of every expert
   held by earlier programs. Then a slot's row = rows of earlier experts + its expert's rows
   in earlier programs + earlier slots of the same expert in the program (from sorting
   (expert, slot) keys); it writes the sort permutation, its inverse and the source token
   of every row.

The barrier needs every program resident at once, so CUDA launches it cooperatively (one
program per SM); Triton's interpreter, which runs programs one after another, runs the two
phases as two launches. The result equals the stable argsort exactly (tests check it
against the reference). On CUDA the expert ids are not range-checked (that would need a
host sync); ids out of range are left out of the counts and their slots unplaced.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mt_ops._dtypes import is_integer
from mt_ops._triton import cdiv, launch, num_sms, tl, triton, use_kernels

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
    if num_ranks is not None and num_ranks < 1:
        raise ValueError(f"num_ranks ({num_ranks}) must be >= 1 (None: no expert parallelism)")
    if num_ranks is not None and num_experts % num_ranks:
        raise ValueError(
            f"num_ranks ({num_ranks}) must divide num_experts ({num_experts}); each EP rank "
            "owns an equal slice of experts: use one of "
            f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0]}"
        )


# Tokens one program sorts per step, and the launch's programs per SM, warps per program
# and counts rows read per step of phase 2. H200, 16k tokens, top-8 of 128 experts, 8
# ranks (``bench_ops_moe.py --sweep``), GPU time: 128 tokens, 8 warps, 128 rows 19.8 us;
# 4 warps 21.3; 32 rows 27.0-29.4; 32 or 64 tokens 21.7-30.8. The three-kernel plan before
# it took 17.1 us of GPU time but three launches of host time (wall 97-175 us against
# 54-61); a [tokens, E] table of picks in place of the sort took 42-400 us.
_PLAN_TOKENS = 128
PLAN_CONFIG = {"programs_per_sm": 1, "warps": 8, "block_q": 128}


@triton.jit
def _grid_barrier(arrived_ptr, target):
    """Waits until ``target`` arrivals are counted at ``arrived_ptr``, counting this program's
    own; the writes before it are then visible to every program. Needs every program of the
    grid resident at once: a cooperative launch (or a one-program grid)."""
    tl.debug_barrier()  # the program's stores are issued before its arrival is published
    tl.atomic_add(arrived_ptr, 1, sem="release")
    # Poll with plain loads (read-modify-writes of one word from every program would queue
    # behind each other in L2), then acquire once.
    while tl.load(arrived_ptr, volatile=True) < target:
        pass
    tl.atomic_add(arrived_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _load_step(ids_ptr, t0, t_end, topk, num_experts, BLOCK_T: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """Expert ids of tokens [t0, t0 + BLOCK_T) ∩ [.., t_end) as [BLOCK_T, BLOCK_K], the
    tokens, and which ids are real: slots past the token range or past K, and ids out of
    [0, E) (not checked on CUDA, and then left unplaced), read as E."""
    tokens = t0 + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    ok = (tokens < t_end)[:, None] & (ks < topk)[None, :]
    slots = tokens[:, None].to(tl.int64) * topk + ks[None, :]
    ids = tl.load(ids_ptr + slots, mask=ok, other=0)
    ok = ok & (ids >= 0) & (ids < num_experts)  # in the ids' own type: int32 would wrap int64s
    return tl.where(ok, ids.to(tl.int32), num_experts), tokens, ok


@triton.jit
def _count_experts(ids, ok, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_E] counts of the real ids of a step (BLOCK_S slots)."""
    real = tl.reshape(ok, [BLOCK_S])
    return tl.histogram(tl.reshape(tl.where(ok, ids, 0), [BLOCK_S]), BLOCK_E, mask=real)


# Program p owns the contiguous tokens [p·Tp, (p+1)·Tp); after the barrier, each slot's row
# is  rows of experts < e + Σ_{q<p} count[q, e] + e's slots earlier in p.  The last term
# comes from sorting each step's (expert, slot) keys: in sorted position j, e's slots
# earlier in the step are j − (step slots of experts < e).
@triton.jit
def _plan_kernel(
    ids_ptr, scratch_ptr, rank_mask_ptr, results_ptr, num_tokens, topk, num_experts,
    num_ranks, results_stride, num_programs,
    HAS_RANKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, PHASES: tl.constexpr,
):  # fmt: skip
    # PHASES: 3 runs both phases with the barrier between them; 1 or 2 runs one phase (the
    # interpreter, which runs programs one after another, launches the two in turn).
    p = tl.program_id(0)
    # int32 scratch (_plan_kernels): the arrival count, then [programs, BLOCK_E] expert counts
    # and [programs, BLOCK_P] rank counts. int64 results: [E] and [P] counts, then three
    # slot arrays of results_stride.
    arrived_ptr = scratch_ptr
    expert_count_ptr = scratch_ptr + 4
    rank_count_ptr = expert_count_ptr + num_programs * BLOCK_E
    tokens_per_program = tl.cdiv(num_tokens, num_programs)
    t_begin = p * tokens_per_program
    t_end = tl.minimum(t_begin + tokens_per_program, num_tokens)
    experts = tl.arange(0, BLOCK_E)
    ranks = tl.arange(0, BLOCK_P)
    if PHASES != 2:  # 1. Count this program's slots per expert and its tokens per rank.
        count = tl.zeros((BLOCK_E,), dtype=tl.int32)
        rank_count = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for t0 in range(t_begin, t_end, BLOCK_T):
            ids, tokens, ok = _load_step(ids_ptr, t0, t_end, topk, num_experts, BLOCK_T, BLOCK_K)
            count += _count_experts(ids, ok, BLOCK_T * BLOCK_K, BLOCK_E)
            if HAS_RANKS:
                rank_of = ids // (num_experts // num_ranks)  # E (masked slots) -> rank P
                hits = (rank_of[:, :, None] == ranks[None, None, :]).to(tl.int32)  # [T, K, P]
                goes = tl.max(hits, axis=1)  # [T, P]: token goes to rank (deduplicated)
                t_ok = tokens < t_end
                p_ok = ranks < num_ranks
                mask_offs = tokens[:, None].to(tl.int64) * num_ranks + ranks[None, :]
                tl.store(rank_mask_ptr + mask_offs, goes.to(tl.int8),
                         mask=t_ok[:, None] & p_ok[None, :])  # fmt: skip
                rank_count += tl.sum(goes, axis=0)
        tl.store(expert_count_ptr + p * BLOCK_E + experts, count)
        tl.store(rank_count_ptr + p * BLOCK_P + ranks, rank_count)
    if PHASES == 3:
        _grid_barrier(arrived_ptr, num_programs)
    if PHASES != 1:
        _rows(
            ids_ptr, expert_count_ptr, rank_count_ptr, results_ptr, p, t_begin, t_end, topk,
            num_experts, num_ranks, results_stride, num_programs, HAS_RANKS, BLOCK_T, BLOCK_K,
            BLOCK_E, BLOCK_P, BLOCK_Q,
        )  # fmt: skip


@triton.jit
def _rows(
    ids_ptr, expert_count_ptr, rank_count_ptr, results_ptr, p, t_begin, t_end, topk,
    num_experts, num_ranks, results_stride, num_programs,
    HAS_RANKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """Phase 2 of ``_plan_kernel`` for program ``p``: the totals (program 0 writes them) and
    the rows of its slots."""
    tokens_per_expert_ptr = results_ptr
    tokens_per_rank_ptr = results_ptr + num_experts
    sorted_slot_ptr = results_ptr + results_stride
    sorted_token_ptr = sorted_slot_ptr + results_stride
    row_of_slot_ptr = sorted_token_ptr + results_stride
    experts = tl.arange(0, BLOCK_E)
    ranks = tl.arange(0, BLOCK_P)
    # 2. Counts of earlier programs and totals.
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    rank_total = tl.zeros((BLOCK_P,), dtype=tl.int32)
    for q0 in range(0, num_programs, BLOCK_Q):
        qs = q0 + tl.arange(0, BLOCK_Q)
        q_ok = qs < num_programs
        counts = tl.load(expert_count_ptr + qs[:, None] * BLOCK_E + experts[None, :],
                         mask=q_ok[:, None], other=0, cache_modifier=".cg")  # fmt: skip
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((qs < p)[:, None], counts, 0), axis=0)
        if HAS_RANKS:
            rank_counts = tl.load(rank_count_ptr + qs[:, None] * BLOCK_P + ranks[None, :],
                                  mask=q_ok[:, None], other=0, cache_modifier=".cg")  # fmt: skip
            rank_total += tl.sum(rank_counts, axis=0)
    if p == 0:
        tl.store(tokens_per_expert_ptr + experts, total.to(tl.int64), mask=experts < num_experts)
        if HAS_RANKS:
            tl.store(tokens_per_rank_ptr + ranks, rank_total.to(tl.int64), mask=ranks < num_ranks)
    # The row of this program's next slot of each expert.
    next_row = tl.cumsum(total, axis=0) - total + before
    # 3. Sort each step's slots by (expert, slot) and write their rows.
    lanes = tl.arange(0, BLOCK_T * BLOCK_K)
    for t0 in range(t_begin, t_end, BLOCK_T):
        ids, _, ok = _load_step(ids_ptr, t0, t_end, topk, num_experts, BLOCK_T, BLOCK_K)
        step_count = _count_experts(ids, ok, BLOCK_T * BLOCK_K, BLOCK_E)
        keys = tl.sort(tl.reshape(ids, [BLOCK_T * BLOCK_K]) * (BLOCK_T * BLOCK_K) + lanes)
        expert = keys // (BLOCK_T * BLOCK_K)
        lane = keys % (BLOCK_T * BLOCK_K)
        # Sorted position j of expert e: rows next_row[e] + j − (step slots of experts < e).
        offset = next_row - (tl.cumsum(step_count, axis=0) - step_count)
        ok = expert < num_experts  # the rest sort last
        rows = tl.gather(offset, tl.where(ok, expert, 0), axis=0) + lanes
        token = t0 + lane // BLOCK_K
        slot = token.to(tl.int64) * topk + lane % BLOCK_K
        tl.store(sorted_slot_ptr + rows, slot, mask=ok)
        tl.store(sorted_token_ptr + rows, token.to(tl.int64), mask=ok)
        tl.store(row_of_slot_ptr + slot, rows.to(tl.int64), mask=ok)
        next_row += step_count


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round2(n: int) -> int:
    return n + n % 2


def _plan_kernels(
    topk_ids_TK: Tensor,
    num_experts: int,
    num_ranks: int | None,
    num_programs: int | None = None,
    block_tokens: int = _PLAN_TOKENS,
) -> DispatchPlan:
    num_tokens, topk = topk_ids_TK.shape
    dev = topk_ids_TK.device
    ids = topk_ids_TK.contiguous()
    has_ranks = num_ranks is not None
    num_p = num_ranks or 1
    on_cuda = dev.type == "cuda"
    if num_programs is None:  # the interpreter's programs run one by one: one is faster there
        num_programs = PLAN_CONFIG["programs_per_sm"] * num_sms(dev) if on_cuda else 1
        num_programs = max(1, min(num_programs, cdiv(num_tokens, block_tokens)))
    block_e, block_p = _pow2(num_experts), _pow2(num_p)
    # Three allocations and few views: the plan's GPU work is ~20 us at 16k tokens on the
    # H200, so its host time per call is what a caller waits for.
    scratch = torch.zeros(4 + num_programs * (block_e + block_p), dtype=torch.int32, device=dev)
    rank_mask_TP = torch.empty(num_tokens if has_ranks else 0, num_p, dtype=torch.int8, device=dev)
    num_slots = num_tokens * topk
    stride = max(_round2(num_slots), _round2(num_experts + num_p))  # 16-byte aligned parts
    results64 = torch.empty(4, stride, dtype=torch.int64, device=dev)
    # On CUDA one cooperative launch, which keeps every program resident as the barrier
    # needs; the interpreter runs programs one after another, so it launches each phase.
    for phases in (3,) if on_cuda else (1, 2):
        launch(
            _plan_kernel, (num_programs,), ids, scratch, rank_mask_TP, results64, num_tokens,
            topk, num_experts, num_p, stride, num_programs,
            HAS_RANKS=has_ranks, BLOCK_T=block_tokens, BLOCK_K=_pow2(topk), BLOCK_E=block_e,
            BLOCK_P=block_p, BLOCK_Q=PLAN_CONFIG["block_q"], PHASES=phases,
            num_warps=PLAN_CONFIG["warps"], launch_cooperative_grid=True,
        )  # fmt: skip
    _, sorted_slot_R, sorted_token_R, row_of_slot_R = results64[:, :num_slots]
    counts64 = results64[0]
    return DispatchPlan(
        tokens_per_expert_E=counts64[:num_experts],
        sorted_token_ids_R=sorted_token_R,
        sorted_slot_R=sorted_slot_R,
        row_of_slot_R=row_of_slot_R,
        num_tokens=num_tokens,
        topk=topk,
        tokens_per_rank_P=counts64[num_experts : num_experts + num_p] if has_ranks else None,
        token_to_rank_TP=rank_mask_TP.view(torch.bool) if has_ranks else None,
    )


def _kernels_apply(topk_ids_TK: Tensor) -> bool:
    # A step sorts 128·K keys in registers; counts and rows are int32 in the kernel.
    return 0 < topk_ids_TK.shape[1] <= 16 and topk_ids_TK.numel() < 2**31


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


def _run_plan_kernels_for_test(
    topk_ids_TK, num_experts, num_ranks=None, num_programs=None, block_tokens=_PLAN_TOKENS
) -> DispatchPlan:
    """The kernel path on any device (Triton's interpreter on CPU); tests use it, also with
    more programs and shorter steps than the defaults."""
    _check(topk_ids_TK, num_experts, num_ranks)
    return _plan_kernels(topk_ids_TK, num_experts, num_ranks, num_programs, block_tokens)


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
