"""RMSNorm: ``x / sqrt(mean(x**2) + eps) * weight`` over the last dim.

Legend: R rows (``x.numel() // D``), D normalized dim, P programs of the backward.

Semantics follow Hugging Face's ``Qwen3RMSNorm``: normalize in fp32, round to the dtype of
``x``, multiply by the weight in the promoted dtype of the two (the weight may be fp32, as
one-GPU autocast training keeps it, or bf16), round the product to the dtype of ``x``. The
result has the dtype of ``x``.

Eager PyTorch (the CPU path: ``F.rms_norm`` on an fp32 copy, then the weight) runs, for a
bf16 ``x`` and an fp32 weight, an upcast copy, the norm, a downcast, an fp32 multiply and
another downcast, each a pass over the activation, and about as many again backward. On
CUDA the op is two Triton kernels. The forward reads ``x`` and writes the output once,
keeping each row's sum of squares in fp32 registers, and saves ``rstd`` (one fp32 per row)
beside ``x`` for the backward. The backward reads ``x``, ``rstd`` and the output gradient
once and writes ``dx``; each of its P programs (up to 16 per multiprocessor) also sums
``g · n`` over its rows into one fp32 row of a [P, D] buffer, added up by one ``sum(0)``
(deterministic: no atomics) into the weight's gradient. That is 2 passes over the
activation forward and 3 backward, plus the partial sums (at most 1/8 of a bf16 ``x``).
Rows longer than ``_RMS_NORM_MAX_BLOCK`` are walked in blocks and read twice (the sum of
squares, then the output; likewise backward). Other dtypes (fp64) and ``D = 0`` take the
eager path.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mt_ops._dtypes import KERNEL_DTYPES
from mt_ops._triton import cdiv, launch, num_sms, tl, triton, use_kernels

__all__ = ["rms_norm", "rms_norm_reference"]

# Elements a program holds per step (rows × padded D): 4096 over 8 warps is 16 per thread,
# two 16-byte bf16 vectors, as in swiglu.py. D = 128 (q_norm) takes 32 rows per step. On an
# H200, 8192 ran the forward no faster and the backward 1.2-1.6x slower (cases below).
_RMS_NORM_TILE = 4096
# Longest row kept in registers at once (16 warps, 16 fp32 per thread); longer rows loop.
# H200, 4096 bf16 rows, fwd + bwd kernel time: D = 8192 in registers 126 us, D = 12000
# looping 278 us (the old eager path: 1161 and 1691 us).
_RMS_NORM_MAX_BLOCK = 8192
# Backward programs per multiprocessor; each walks every P-th step of rows and keeps its own
# fp32 weight-gradient row. H200 kernel time of forward + backward + the partials' sum, for
# q_norm [4, 4096, 32, 128] bf16 / hidden [16384, 2048] fp32 / the same in bf16: 4 per SM
# 218 / 195 / 113 us, 16 per SM 200 / 180 / 111 us, 64 per SM 235 / 213 / 148 us.
_RMS_NORM_BWD_PROGRAMS_PER_SM = 16
# ...but each program takes at least this many rows, so the partial sums (P × D fp32) stay
# within 1/8 of a bf16 x's bytes (8192 rows of 4096 take 512 programs, not 2112).
_RMS_NORM_BWD_MIN_ROWS = 16
# Backward programs on CPU tensors (the interpreter): several, so tests cover the split.
_RMS_NORM_BWD_PROGRAMS_CPU = 3


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, num_rows, dim, x_row_stride, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """BLOCK_ROWS rows: ``rstd = rsqrt(mean(x²) + eps)`` in fp32, ``y = w · round(x · rstd)``
    rounded to y's dtype; ONE_BLOCK when the padded row fits in BLOCK_D (one load of x)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows_ok = rows < num_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * dim
    cols = tl.arange(0, BLOCK_D)
    if ONE_BLOCK:
        cols_ok = cols < dim
        ok = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
        w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
        n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_rows + cols[None, :], (w[None, :] * n).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for start in range(0, dim, BLOCK_D):
            ok = rows_ok[:, None] & (start + cols < dim)[None, :]
            x = tl.load(x_rows + start + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / dim + eps)
        for start in range(0, dim, BLOCK_D):
            cols_ok = start + cols < dim
            ok = rows_ok[:, None] & cols_ok[None, :]
            x = tl.load(x_rows + start + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=cols_ok, other=0.0).to(tl.float32)
            n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            y = (w[None, :] * n).to(y_ptr.dtype.element_ty)
            tl.store(y_rows + start + cols[None, :], y, mask=ok)
    tl.store(rstd_ptr + rows, rstd, mask=rows_ok)


@triton.jit
def _bwd_block(
    x_ptr, grad_ptr, w_ptr, rows64, rows_ok, start, cols, dim, x_row_stride, grad_row_stride
):  # fmt: skip
    """Columns [start, start + BLOCK_D) of the rows: x (its dtype), g and w (fp32), masks
    and offsets."""
    cols_ok = start + cols < dim
    ok = rows_ok[:, None] & cols_ok[None, :]
    offs = start + cols[None, :]
    x = tl.load(x_ptr + rows64 * x_row_stride + offs, mask=ok, other=0.0)
    g = tl.load(grad_ptr + rows64 * grad_row_stride + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + start + cols, mask=cols_ok, other=0.0).to(tl.float32)
    return x, g, w, cols_ok, ok, offs


@triton.jit
def _rms_norm_bwd_kernel(
    grad_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, num_rows, dim, grad_row_stride,
    x_row_stride,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
):  # fmt: skip
    """Steps of BLOCK_ROWS rows, every P-th from the program's own: with ``n = x · rstd``,
    ``dx = rstd · (g·w − n · mean(g·w·n))`` and the program's fp32 row of ``Σ g · round(n)``
    (kept in registers with ONE_BLOCK; added into the zeroed buffer step by step otherwise)."""
    pid = tl.program_id(0)
    num_steps = tl.cdiv(num_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    partial = dw_partial_ptr + pid.to(tl.int64) * dim
    if ONE_BLOCK:
        cols_ok = cols < dim
        w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for step in range(pid, num_steps, tl.num_programs(0)):
            rows = step * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            rows_ok = rows < num_rows
            ok = rows_ok[:, None] & cols_ok[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=ok, other=0.0)
            g = tl.load(grad_ptr + rows64 * grad_row_stride + cols[None, :], mask=ok, other=0.0)
            g = g.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rows_ok, other=0.0)[:, None]
            n = x.to(tl.float32) * rstd
            if NEED_DW:
                dw_acc += g * n.to(x_ptr.dtype.element_ty).to(tl.float32)
            if NEED_DX:
                gw = g * w[None, :]
                mean_gwn = tl.sum(gw * n, axis=1)[:, None] / dim
                dx = rstd * (gw - n * mean_gwn)
                tl.store(dx_ptr + rows64 * dim + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                         mask=ok)  # fmt: skip
        if NEED_DW:
            tl.store(partial + cols, tl.sum(dw_acc, axis=0), mask=cols_ok)
    else:
        for step in range(pid, num_steps, tl.num_programs(0)):
            rows = step * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            rows_ok = rows < num_rows
            rows64 = rows.to(tl.int64)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=rows_ok, other=0.0)[:, None]
            mean_gwn = tl.zeros([BLOCK_ROWS, 1], tl.float32)
            if NEED_DX:
                sum_gwn = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
                for start in range(0, dim, BLOCK_D):
                    x, g, w, _, _, _ = _bwd_block(
                        x_ptr, grad_ptr, w_ptr, rows64, rows_ok, start, cols, dim,
                        x_row_stride, grad_row_stride,
                    )  # fmt: skip
                    sum_gwn += g * w[None, :] * (x.to(tl.float32) * rstd)
                mean_gwn = tl.sum(sum_gwn, axis=1)[:, None] / dim
            for start in range(0, dim, BLOCK_D):
                x, g, w, cols_ok, ok, offs = _bwd_block(
                    x_ptr, grad_ptr, w_ptr, rows64, rows_ok, start, cols, dim, x_row_stride,
                    grad_row_stride,
                )  # fmt: skip
                n = x.to(tl.float32) * rstd
                if NEED_DW:
                    dw = tl.sum(g * n.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
                    acc = tl.load(partial + start + cols, mask=cols_ok, other=0.0)
                    tl.store(partial + start + cols, acc + dw, mask=cols_ok)
                if NEED_DX:
                    gw = g * w[None, :]
                    dx = rstd * (gw - n * mean_gwn)
                    tl.store(dx_ptr + rows64 * dim + offs, dx.to(dx_ptr.dtype.element_ty),
                             mask=ok)  # fmt: skip
            # The next step's threads read back what other threads of the program stored.
            tl.debug_barrier()


def _blocks(dim: int) -> tuple[int, int, bool]:
    """``(BLOCK_ROWS, BLOCK_D, ONE_BLOCK)``: the whole padded row in one block when it fits
    ``_RMS_NORM_MAX_BLOCK``, and as many rows per step as fill ``_RMS_NORM_TILE``."""
    padded = 1 << max(0, (dim - 1).bit_length())
    block_d = min(padded, _RMS_NORM_MAX_BLOCK)
    return max(1, _RMS_NORM_TILE // block_d), block_d, block_d >= dim


def _num_warps(block_rows: int, block_d: int) -> int:
    return min(16, max(4, block_rows * block_d // 512))  # 16 elements per thread


def _as_rows(t: Tensor) -> Tensor:
    """``t`` as [R, D] with unit column stride: a view when the leading dims merge."""
    rows_RD = t.reshape(-1, t.shape[-1])
    return rows_RD if rows_RD.stride(1) == 1 else rows_RD.contiguous()


def _rms_norm_fwd(x_RD: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    num_rows, dim = x_RD.shape
    y_RD = torch.empty((num_rows, dim), dtype=x_RD.dtype, device=x_RD.device)
    rstd_R = torch.empty(num_rows, dtype=torch.float32, device=x_RD.device)
    block_rows, block_d, one_block = _blocks(dim)
    launch(
        _rms_norm_fwd_kernel, (cdiv(num_rows, block_rows),), x_RD, weight, y_RD, rstd_R,
        num_rows, dim, x_RD.stride(0), eps, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        ONE_BLOCK=one_block, num_warps=_num_warps(block_rows, block_d),
    )  # fmt: skip
    return y_RD, rstd_R


def _rms_norm_bwd(
    grad_RD: Tensor, x_RD: Tensor, weight: Tensor, rstd_R: Tensor, need_dx: bool, need_dw: bool
) -> tuple[Tensor | None, Tensor | None]:
    num_rows, dim = x_RD.shape
    block_rows, block_d, one_block = _blocks(dim)
    if x_RD.is_cuda:
        max_programs = num_sms(x_RD.device) * _RMS_NORM_BWD_PROGRAMS_PER_SM
    else:
        max_programs = _RMS_NORM_BWD_PROGRAMS_CPU
    num_programs = min(cdiv(num_rows, block_rows), cdiv(num_rows, _RMS_NORM_BWD_MIN_ROWS),
                       max_programs)  # fmt: skip
    dx_RD = torch.empty_like(x_RD, memory_format=torch.contiguous_format) if need_dx else None
    # One fp32 row per program; zeroed when the programs add into it block by block.
    alloc = torch.empty if one_block else torch.zeros
    dw_partial_PD = alloc(
        (num_programs if need_dw else 0, dim), dtype=torch.float32, device=x_RD.device
    )
    launch(
        _rms_norm_bwd_kernel, (num_programs,), grad_RD, x_RD, weight, rstd_R,
        x_RD if dx_RD is None else dx_RD, dw_partial_PD, num_rows, dim, grad_RD.stride(0),
        x_RD.stride(0), BLOCK_ROWS=block_rows, BLOCK_D=block_d, ONE_BLOCK=one_block,
        NEED_DX=need_dx, NEED_DW=need_dw, num_warps=_num_warps(block_rows, block_d),
    )  # fmt: skip
    dw = dw_partial_PD.sum(0).to(weight.dtype) if need_dw else None
    return dx_RD, dw


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x_RD = _as_rows(x)
        weight = weight.contiguous()
        y_RD, rstd_R = _rms_norm_fwd(x_RD, weight, eps)
        ctx.save_for_backward(x_RD, weight, rstd_R)
        ctx.x_shape = x.shape
        return y_RD.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x_RD, weight, rstd_R = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx_RD, dw = _rms_norm_bwd(_as_rows(grad), x_RD, weight, rstd_R, need_dx, need_dw)
        return None if dx_RD is None else dx_RD.view(ctx.x_shape), dw, None


def _check(x: Tensor, weight: Tensor, eps: float) -> None:
    if not eps >= 0:  # a negative eps made rows of small mean square NaN; NaN every row
        raise ValueError(f"eps ({eps}) must be >= 0; the usual values are 1e-6 and 1e-5")
    if not x.dtype.is_floating_point:  # an integer x would come back truncated to integers
        raise ValueError(
            f"x dtype ({x.dtype}) must be a floating-point type; convert it first, e.g. "
            "x.float()"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight shape ({tuple(weight.shape)}) must be [D] with D = x.shape[-1] "
            f"({x.shape[-1]}); pass a 1-D weight of the normalized dim"
        )


def _rms_norm_eager(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The CPU path (and the public op before the kernels): ``F.rms_norm`` on an fp32 copy."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Root-mean-square normalization over the last dim, computed in fp32.

    Args:
        x: Input of shape [..., D], any float dtype.
        weight: Per-channel scale of shape [D].
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        Tensor of the shape and dtype of ``x``.
    """
    _check(x, weight, eps)
    fused = x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and x.shape[-1] > 0
    if fused and use_kernels(x, weight):
        return _RMSNormFn.apply(x, weight, float(eps))
    return _rms_norm_eager(x, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Plain-PyTorch reference of :func:`rms_norm` (Hugging Face ``Qwen3RMSNorm``).

    Args:
        x: Input of shape [..., D], any float dtype.
        weight: Per-channel scale of shape [D].
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        Tensor of the shape and dtype of ``x``.
    """
    _check(x, weight, eps)
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def _kernel_function_for_test():
    """``rms_norm`` through the kernels on any device (the interpreter on CPU)."""

    def rms_norm_kernel(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        _check(x, weight, eps)
        return _RMSNormFn.apply(x, weight, float(eps))

    return rms_norm_kernel
