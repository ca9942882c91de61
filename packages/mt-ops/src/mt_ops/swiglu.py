"""SwiGLU activation: ``silu(gate) * up``.

Eager PyTorch computes ``silu(gate)`` into a temporary and multiplies it by ``up`` in a
second kernel, and autograd saves ``gate``, ``up`` and the temporary; the backward is
another four or five elementwise kernels. The fused kernel reads ``gate`` and ``up`` once
and writes the product; the backward recomputes ``sigmoid`` from the two saved inputs and
writes both gradients in one pass (3 reads + 2 writes instead of ~10 passes).

On CPU, and for dtypes other than fp32, bf16 and fp16 (the kernels compute in fp32), the
public op is the eager expression; the reference spells out ``sigmoid`` in fp32.
``gate`` and ``up`` must share a dtype, under autocast too (which leaves elementwise ops
alone), so that every path returns that dtype.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mt_ops._dtypes import KERNEL_DTYPES, compute_dtype
from mt_ops._triton import cdiv, launch, sigmoid, tl, triton, use_kernels

__all__ = ["swiglu", "swiglu_reference"]

# Elements per program: 4096 over 8 warps is 16 per thread (two 16-byte bf16 vectors).
_SWIGLU_BLOCK = 4096


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    out = g * sigmoid(g) * u
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dout = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig = sigmoid(g)
    silu = g * sig
    dgate = dout * u * sig * (1.0 + g * (1.0 - sig))  # d silu/dg = σ(1 + g(1 − σ))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=ok)
    tl.store(dup_ptr + offs, (dout * silu).to(dup_ptr.dtype.element_ty), mask=ok)


def _swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    out = torch.empty_like(gate)
    n = gate.numel()
    launch(_swiglu_fwd_kernel, (cdiv(n, _SWIGLU_BLOCK),), gate, up, out, n,
           BLOCK=_SWIGLU_BLOCK, num_warps=8)  # fmt: skip
    return out


def _swiglu_bwd(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    launch(_swiglu_bwd_kernel, (cdiv(n, _SWIGLU_BLOCK),), grad, gate, up, dgate, dup, n,
           BLOCK=_SWIGLU_BLOCK, num_warps=8)  # fmt: skip
    return dgate, dup


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return _swiglu_bwd(grad.contiguous(), gate, up)


def _check(gate: Tensor, up: Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"gate shape ({tuple(gate.shape)}) must equal up shape ({tuple(up.shape)}); "
            "split a fused gate_up projection into two equal halves"
        )
    # A mix gave the eager op PyTorch's promoted dtype but the reference gate's dtype (the
    # kernel writes gate's too). Autocast casts no elementwise op: no exception under it.
    if gate.dtype != up.dtype:
        raise ValueError(
            f"up dtype ({up.dtype}) must equal gate dtype ({gate.dtype}); pass "
            "up.to(gate.dtype), or produce both with the same projection dtype"
        )


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Gated SiLU: ``silu(gate) * up``.

    Args:
        gate: Gate projection, any shape.
        up: Up projection, same shape and dtype as ``gate``.

    Returns:
        Tensor of the shape and dtype of ``gate``.
    """
    _check(gate, up)
    if use_kernels(gate, up) and gate.numel() and gate.dtype in KERNEL_DTYPES:
        return _SwiGLUFn.apply(gate.contiguous(), up.contiguous())
    return F.silu(gate) * up


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch reference of :func:`swiglu`, computed in fp32 (fp64 for fp64 inputs).

    Args:
        gate: Gate projection, any shape.
        up: Up projection, same shape and dtype as ``gate``.

    Returns:
        Tensor of the shape and dtype of ``gate``.
    """
    _check(gate, up)
    dtype = compute_dtype(gate.dtype)
    g = gate.to(dtype)
    return (g * torch.sigmoid(g) * up.to(dtype)).to(gate.dtype)


def _kernel_function_for_test():
    """The fused autograd function, runnable on CPU through Triton's interpreter."""
    return _SwiGLUFn
