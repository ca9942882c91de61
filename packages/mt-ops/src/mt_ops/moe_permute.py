"""MoE token permutation: put tokens into expert order, and the weighted combine back.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (R = T·K, or the plan's
first ``num_rows`` when only those are kept).

The routing plan (:mod:`mt_ops.moe_plan`) sorts the T·K slots by expert. ``permute``
puts token rows into that order; ``unpermute`` brings expert outputs back, weights them
by the router's top-k weights and sums the K rows per token.

Eager PyTorch permutes with ``index_select`` (which reads a token row from memory up to K
times once the tokens outgrow L2) and its backward is an ``index_add`` with atomics; the
combine is a gather, an fp32 upcast, a multiply and a sum, four passes with [T, K, D] fp32
temporaries, plus a backward of similar cost. The kernels here move each byte once: permute
reads each token row once and writes it to its K routed rows; permute's backward and
unpermute's forward are one *gather-sum* over each token's K rows (via the inverse
permutation, fixed order, no atomics, fp32 accumulation); and unpermute's backward writes
the routed-row gradient and the top-k weight gradient in one pass. On CPU the same math
runs as eager PyTorch (``*_reference``).
"""

import torch
from torch import Tensor

from mt_ops._dtypes import autocast_dtype, compute_dtype
from mt_ops._triton import launch, tl, triton, use_kernels
from mt_ops.moe_plan import DispatchPlan, plan_dispatch, plan_dispatch_reference

__all__ = [
    "DispatchPlan",
    "permute",
    "permute_reference",
    "plan_dispatch",
    "plan_dispatch_reference",
    "unpermute",
    "unpermute_reference",
]

# Columns per loop step and warps of the permute (fwd_), the gather-sum (permute backward,
# unpermute forward) and the unpermute backward (bwd_), set by ``bench_ops_moe.py --sweep``
# on the H200. The permute scatters (one program per token, its row read once) rather than
# gathering (one program per routed row): x is larger than L2 at 16k tokens, so the gather
# read most token rows K times from memory (240 us, 0.59x copy bandwidth, Qwen3 shapes).
PERMUTE_CONFIG = {
    "fwd_BLOCK_D": 1024, "fwd_warps": 4,
    "BLOCK_D": 1024, "warps": 4,
    "bwd_BLOCK_D": 1024, "bwd_warps": 4,
}  # fmt: skip


@triton.jit
def _scatter_rows_kernel(
    src_ptr, row_of_slot_ptr, dst_ptr, D, K, num_rows,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per token: its row is read once and written to its K routed rows (those
    # below num_rows; the rest are dropped).
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.load(row_of_slot_ptr + t * K + ks, mask=ks < K, other=0)
    k_ok = (ks < K) & (rows < num_rows)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        c_ok = cols < D
        v = tl.load(src_ptr + t * D + cols, mask=c_ok)
        v_KD = tl.broadcast_to(v[None, :], (BLOCK_K, BLOCK_D))
        tl.store(
            dst_ptr + rows[:, None] * D + cols[None, :],
            v_KD.to(dst_ptr.dtype.element_ty),
            mask=k_ok[:, None] & c_ok[None, :],
        )


@triton.jit
def _gather_sum_kernel(
    y_ptr, row_of_slot_ptr, weight_ptr, out_ptr, D, K, num_rows,
    HAS_WEIGHT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.load(row_of_slot_ptr + t * K + ks, mask=ks < K, other=0)
    k_ok = (ks < K) & (rows < num_rows)  # dropped rows (num_rows and up) count as zero
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + t * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = k_ok[:, None] & (cols < D)[None, :]
        v = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            v = v * w[:, None]
        tl.store(
            out_ptr + t * D + cols, tl.sum(v, axis=0).to(out_ptr.dtype.element_ty), mask=cols < D
        )


@triton.jit
def _unpermute_bwd_kernel(
    grad_out_ptr, y_ptr, row_of_slot_ptr, weight_ptr, grad_y_ptr, grad_w_ptr, D, K, num_rows,
    WRITE_GRAD_Y: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.load(row_of_slot_ptr + t * K + ks, mask=ks < K, other=0)
    k_ok = (ks < K) & (rows < num_rows)  # a dropped row is zero: no gradient to write
    w = tl.load(weight_ptr + t * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    dots = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        c_ok = cols < D
        ok = k_ok[:, None] & c_ok[None, :]
        g = tl.load(grad_out_ptr + t * D + cols, mask=c_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dots += tl.sum(y * g[None, :], axis=1)
        if WRITE_GRAD_Y:  # (without: a fused consumer makes the routed-row gradient itself)
            grad_y = (w[:, None] * g[None, :]).to(grad_y_ptr.dtype.element_ty)
            tl.store(grad_y_ptr + rows[:, None] * D + cols[None, :], grad_y, mask=ok)
    tl.store(grad_w_ptr + t * K + ks, dots.to(grad_w_ptr.dtype.element_ty), mask=ks < K)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scatter_rows(x_TD, plan, num_rows, out_dtype=None):
    dst = torch.empty(num_rows, x_TD.shape[1], dtype=out_dtype or x_TD.dtype, device=x_TD.device)
    launch(
        _scatter_rows_kernel, (plan.num_tokens,), x_TD, plan.row_of_slot_R, dst, x_TD.shape[1],
        plan.topk, num_rows, BLOCK_K=_pow2(plan.topk), BLOCK_D=PERMUTE_CONFIG["fwd_BLOCK_D"],
        num_warps=PERMUTE_CONFIG["fwd_warps"],
    )  # fmt: skip
    return dst


def _gather_sum(y_RD, plan, weights_TK=None, out_dtype=None):
    """Per token, the (weighted) sum of its K routed rows; rows past y_RD's end count as 0."""
    out = torch.empty(
        plan.num_tokens, y_RD.shape[1], dtype=out_dtype or y_RD.dtype, device=y_RD.device
    )
    launch(
        _gather_sum_kernel, (plan.num_tokens,), y_RD, plan.row_of_slot_R,
        y_RD if weights_TK is None else weights_TK, out, y_RD.shape[1], plan.topk, y_RD.shape[0],
        HAS_WEIGHT=weights_TK is not None, BLOCK_K=_pow2(plan.topk),
        BLOCK_D=PERMUTE_CONFIG["BLOCK_D"], num_warps=PERMUTE_CONFIG["warps"],
    )  # fmt: skip
    return out


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, plan, num_rows, out_dtype):
        ctx.plan, ctx.x_dtype = plan, x_TD.dtype
        return _scatter_rows(x_TD, plan, num_rows, out_dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        return _gather_sum(grad_RD.contiguous(), ctx.plan, out_dtype=ctx.x_dtype), None, None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD, plan, weights_TK):
        ctx.plan = plan
        ctx.save_for_backward(y_RD, weights_TK)
        return _gather_sum(y_RD, plan, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_RD, weights_TK = ctx.saved_tensors
        grad_y, grad_w = _unpermute_backward(grad_TD.contiguous(), y_RD, ctx.plan, weights_TK)
        return grad_y, None, grad_w


def _unpermute_backward(grad_TD, y_RD, plan, weights_TK, grad_y=True):
    """Unpermute's ``(grad_y, grad_w)`` in one pass; ``grad_y=False`` computes only the
    top-k weight gradient (``grad_y`` is then None)."""
    grad_y_RD = torch.empty_like(y_RD) if grad_y else None
    grad_w = torch.empty(weights_TK.shape, dtype=weights_TK.dtype, device=y_RD.device)
    launch(
        _unpermute_bwd_kernel, (plan.num_tokens,), grad_TD, y_RD, plan.row_of_slot_R,
        weights_TK, y_RD if grad_y_RD is None else grad_y_RD, grad_w, y_RD.shape[1],
        plan.topk, y_RD.shape[0], WRITE_GRAD_Y=grad_y, BLOCK_K=_pow2(plan.topk),
        BLOCK_D=PERMUTE_CONFIG["bwd_BLOCK_D"], num_warps=PERMUTE_CONFIG["bwd_warps"],
    )  # fmt: skip
    return grad_y_RD, grad_w


def _kernels_sum_in(rows: Tensor, *others: Tensor) -> bool:
    """Whether the kernels run and sum ``rows`` in the precision the references use: they
    sum in fp32, so fp64 rows (whose references sum in fp64) take the references."""
    return use_kernels(rows, *others) and compute_dtype(rows.dtype) == torch.float32


def _num_rows(plan: DispatchPlan, num_rows: int | None) -> int:
    """The routed rows kept: all T·K by default, else the first ``num_rows``."""
    total = plan.num_tokens * plan.topk
    if num_rows is None:
        return total
    if isinstance(num_rows, Tensor) or not isinstance(num_rows, int):
        raise TypeError(
            f"num_rows must be a Python int, got {type(num_rows).__name__}; it sizes the "
            "output on the host, so read a device count once with int(...) or .tolist()"
        )
    if not 0 <= num_rows <= total:
        raise ValueError(
            f"num_rows ({num_rows}) must be in [0, T·K = {total}]: the plan's first rows, "
            "those of the experts kept"
        )
    return num_rows


def _check_permute(x_TD: Tensor, plan: DispatchPlan) -> None:
    if x_TD.dim() != 2 or x_TD.shape[0] != plan.num_tokens:
        raise ValueError(
            f"x shape ({tuple(x_TD.shape)}) must be [T={plan.num_tokens}, D]; pass the "
            "tokens the plan was made for"
        )


def _routed_dtype(x_TD: Tensor) -> torch.dtype:
    dtype = autocast_dtype(x_TD.device) if x_TD.is_floating_point() else None
    return dtype or x_TD.dtype


def permute(x_TD: Tensor, plan: DispatchPlan, *, num_rows: int | None = None) -> Tensor:
    """Put token rows into expert order (each token appears K times).

    Under autocast the routed rows come out in the autocast dtype: they only feed the
    experts' matmuls, which would each cast them, so fp32 tokens (one-GPU training) are
    cast once while being moved, at half the bytes written. The gradient comes back in the
    dtype of ``x_TD``, each token's K rows summed in fp32 (fp64 for fp64 ``x_TD``).

    Args:
        x_TD: Token activations [T, D].
        plan: The plan from :func:`plan_dispatch` for these T tokens.
        num_rows: Keep only the first ``num_rows`` routed rows, leaving out the plan's last
            experts (expert parallelism's bucket of choices that other ranks serve); default
            all T·K. Dropped rows are never written.

    Returns:
        Routed rows [R, D] (R = num_rows), expert e's rows consecutive, in expert order,
        in the dtype of ``x_TD`` (the autocast dtype under autocast).
    """
    _check_permute(x_TD, plan)
    num_rows = _num_rows(plan, num_rows)
    if not _kernels_sum_in(x_TD) or num_rows == 0:
        return permute_reference(x_TD, plan, num_rows=num_rows)
    return _PermuteFn.apply(x_TD.contiguous(), plan, num_rows, _routed_dtype(x_TD))


def permute_reference(x_TD: Tensor, plan: DispatchPlan, *, num_rows: int | None = None) -> Tensor:
    """Eager reference of :func:`permute`: ``index_select`` (same arguments and result)."""
    _check_permute(x_TD, plan)
    rows_RD = x_TD.index_select(0, plan.sorted_token_ids_R[: _num_rows(plan, num_rows)])
    return rows_RD.to(_routed_dtype(x_TD))  # [R, D]


def _check_unpermute(y_RD: Tensor, plan: DispatchPlan, topk_weights_TK: Tensor, num_rows) -> int:
    num_tokens, topk = plan.num_tokens, plan.topk
    num_rows = _num_rows(plan, num_rows)
    if y_RD.dim() != 2 or y_RD.shape[0] != num_rows:
        raise ValueError(
            f"y shape ({tuple(y_RD.shape)}) must be [R={num_rows}, D]; pass one "
            "output row per routed row" + ("" if num_rows == num_tokens * topk else " kept")
        )
    if tuple(topk_weights_TK.shape) != (num_tokens, topk):
        raise ValueError(
            f"topk_weights shape ({tuple(topk_weights_TK.shape)}) must be "
            f"[T, K] = [{num_tokens}, {topk}]"
        )
    return num_rows


def unpermute(
    y_RD: Tensor, plan: DispatchPlan, topk_weights_TK: Tensor, *, num_rows: int | None = None
) -> Tensor:
    """Weight each routed row by its top-k weight and sum the K rows of every token.

    Args:
        y_RD: Expert outputs [R, D] in the plan's row order.
        plan: The plan from :func:`plan_dispatch`.
        topk_weights_TK: Router weight of each token's k-th choice [T, K].
        num_rows: R, when only the plan's first rows exist (see :func:`permute`); the
            dropped rows count as zero (and get no gradient). Default all T·K.

    Returns:
        ``out[t] = Σ_k w[t, k] · y[row of (t, k)]``, shape [T, D], dtype of ``y_RD``,
        summed in fp32 (in fp64 for fp64 ``y_RD``).
    """
    num_rows = _check_unpermute(y_RD, plan, topk_weights_TK, num_rows)
    if not _kernels_sum_in(y_RD, topk_weights_TK) or plan.num_tokens * plan.topk == 0:
        return unpermute_reference(y_RD, plan, topk_weights_TK, num_rows=num_rows)
    return _UnpermuteFn.apply(y_RD.contiguous(), plan, topk_weights_TK.contiguous())


def unpermute_reference(
    y_RD: Tensor, plan: DispatchPlan, topk_weights_TK: Tensor, *, num_rows: int | None = None
) -> Tensor:
    """Eager reference of :func:`unpermute` (same arguments and result)."""
    num_rows = _check_unpermute(y_RD, plan, topk_weights_TK, num_rows)
    num_tokens, topk = plan.num_tokens, plan.topk
    y_RD = torch.nn.functional.pad(y_RD, (0, 0, 0, num_tokens * topk - num_rows))  # dropped: 0
    y_SD = y_RD.index_select(0, plan.row_of_slot_R)  # [T*K, D], slot order
    y_TKD = y_SD.view(num_tokens, topk, y_RD.shape[1])  # [T, K, D]
    dtype = compute_dtype(y_RD.dtype)
    weighted_TKD = y_TKD.to(dtype) * topk_weights_TK.to(dtype).unsqueeze(-1)  # [T, K, D]
    return weighted_TKD.sum(dim=1).to(y_RD.dtype)  # [T, D]


def _kernel_functions_for_test():
    """``permute`` and ``unpermute`` through the kernels on any device (the interpreter on
    CPU): same arguments as the public ops, checks included."""

    def permute_kernel(x_TD, plan, *, num_rows=None):
        _check_permute(x_TD, plan)
        return _PermuteFn.apply(x_TD, plan, _num_rows(plan, num_rows), _routed_dtype(x_TD))

    def unpermute_kernel(y_RD, plan, topk_weights_TK, *, num_rows=None):
        _check_unpermute(y_RD, plan, topk_weights_TK, num_rows)
        return _UnpermuteFn.apply(y_RD, plan, topk_weights_TK)

    return permute_kernel, unpermute_kernel
