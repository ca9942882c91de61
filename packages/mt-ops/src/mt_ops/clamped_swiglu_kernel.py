"""Fused kernel for GPT-OSS's clamped SwiGLU (the op and its reference: ``clamped_swiglu.py``).

``out = (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``,
gate and up interleaved in the last dim of ``gate_up`` (gate at even, up at odd indices).

The eager op runs two strided slices, two clamps, a sigmoid and three multiplies, and its
backward as many again. This kernel reads ``gate_up`` once and writes ``out``; the backward
recomputes the activation from the saved ``gate_up`` and writes the interleaved gradient in
one pass. On CPU, and for dtypes other than fp32, bf16 and fp16 (the kernels compute in
fp32), :func:`clamped_swiglu_fused` runs the eager op.
"""

import torch
from torch import Tensor

from mt_ops._dtypes import KERNEL_DTYPES
from mt_ops._triton import cdiv, launch, sigmoid, tl, triton, use_kernels
from mt_ops.clamped_swiglu import clamped_swiglu

__all__ = ["clamped_swiglu_fused"]

# Output elements per program (each reads a gate and an up value): 2048 over 4 warps.
_BLOCK = 2048


@triton.jit
def _clamped_swiglu_fwd_kernel(gu_ptr, out_ptr, n, alpha, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gu_ptr + 2 * offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + 2 * offs + 1, mask=ok, other=0.0).to(tl.float32)
    # NaN stays NaN, as in clamp (by default min/max return the other operand on CUDA).
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    out = (u + 1.0) * g * sigmoid(alpha * g)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _clamped_swiglu_bwd_kernel(grad_ptr, gu_ptr, dgu_ptr, n, alpha, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dout = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g_in = tl.load(gu_ptr + 2 * offs, mask=ok, other=0.0).to(tl.float32)
    u_in = tl.load(gu_ptr + 2 * offs + 1, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(g_in, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u_in, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    sig = sigmoid(alpha * g)
    glu = g * sig
    # clamp passes the gradient where its input lies inside the bounds (inclusive).
    d_up = tl.where((u_in >= -limit) & (u_in <= limit), dout * glu, 0.0)
    d_gate = dout * (u + 1.0) * (sig + alpha * glu * (1.0 - sig))
    d_gate = tl.where(g_in <= limit, d_gate, 0.0)
    tl.store(dgu_ptr + 2 * offs, d_gate.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(dgu_ptr + 2 * offs + 1, d_up.to(dgu_ptr.dtype.element_ty), mask=ok)


class _ClampedSwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, alpha, limit):
        out = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype,
                          device=gate_up.device)  # fmt: skip
        n = out.numel()
        launch(_clamped_swiglu_fwd_kernel, (cdiv(n, _BLOCK),), gate_up, out, n, alpha, limit,
               BLOCK=_BLOCK, num_warps=4)  # fmt: skip
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit = alpha, limit
        return out

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        grad_gate_up = torch.empty_like(gate_up)
        n = grad.numel()
        launch(_clamped_swiglu_bwd_kernel, (cdiv(n, _BLOCK),), grad.contiguous(), gate_up,
               grad_gate_up, n, ctx.alpha, ctx.limit, BLOCK=_BLOCK, num_warps=4)  # fmt: skip
        return grad_gate_up, None, None


def clamped_swiglu_fused(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """:func:`mt_ops.clamped_swiglu` as one fused kernel on CUDA (same arguments and result).

    Args:
        gate_up: Interleaved gate/up projection [..., 2F] (gate at even, up at odd indices).
        alpha: Slope inside the sigmoid (``swiglu_alpha``).
        limit: Clamp bound (``swiglu_limit``).

    Returns:
        Tensor [..., F] in the dtype of ``gate_up``.
    """
    fused = use_kernels(gate_up) and gate_up.dtype in KERNEL_DTYPES and gate_up.numel() > 0
    if not fused or gate_up.shape[-1] % 2:
        return clamped_swiglu(gate_up, alpha, limit)  # also raises on bad arguments
    if not (alpha > 0 and limit > 0):  # NaN too: the eager op raises
        return clamped_swiglu(gate_up, alpha, limit)
    return _ClampedSwiGLUFn.apply(gate_up.contiguous(), float(alpha), float(limit))


def _kernel_function_for_test():
    """The fused autograd function, runnable on CPU through Triton's interpreter."""
    return _ClampedSwiGLUFn
