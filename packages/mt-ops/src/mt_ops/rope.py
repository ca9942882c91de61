"""Rotary position embedding (RoPE), Hugging Face's non-interleaved convention.

The head dim is split into two halves ``(x1, x2)``; each pair ``(x1[i], x2[i])`` is
rotated by the angle of frequency ``i``: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)`` and ``cos``/``sin`` holding each frequency twice
(``cat(freqs, freqs)``). Eager PyTorch runs an upcast, a slice, a negation, a
concatenation and three elementwise kernels per call, each a trip through memory with fp32
temporaries, and as many again in the backward. On CUDA the op is one Triton kernel: a
program per (batch, position) row loads the row's cos and sin once, rotates every head in
fp32 and writes the result in the dtype of ``x``; the backward is the same kernel rotating
the gradient by the opposite angles (the transpose of the rotation). ``x`` may be a strided
view (a split of a projection, or a transposed gradient) as long as its last dim is
contiguous.

Both ops compute in fp32 (the reference in fp64 for fp64 ``x``: the CPU path, and the path
of every ``x`` other than fp32, bf16 and fp16) and return the dtype of ``x``.
"""

import torch
from torch import Tensor

from mt_ops._dtypes import KERNEL_DTYPES, compute_dtype
from mt_ops._triton import launch, tl, triton, use_kernels

__all__ = ["apply_rope", "apply_rope_reference"]

# Heads per loop step of the kernel (at most this many rows of [heads, head_dim / 2] at once).
_ROPE_BLOCK_H = 16


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, num_heads, half, x_stride_b, x_stride_s,
    x_stride_h, cs_stride_b, cs_stride_s,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row (b, s): ``out = (x1·c1 - x2·s1, x2·c2 + x1·s2)`` for every head, halves (x1, x2)
    and table halves (c1, c2), (s1, s2); INVERSE applies the transpose (the backward)."""
    row = tl.program_id(0)
    b = (row // seq_len).to(tl.int64)
    pos = (row % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    table = b * cs_stride_b + pos * cs_stride_s + d
    c1 = tl.load(cos_ptr + table, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + half, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + half, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    x_row = x_ptr + b * x_stride_b + pos * x_stride_s
    out_row = out_ptr + row.to(tl.int64) * num_heads * 2 * half
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        ok = (heads < num_heads)[:, None] & d_ok[None, :]
        src = x_row + heads[:, None].to(tl.int64) * x_stride_h + d[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
        if INVERSE:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        dst = out_row + heads[:, None] * 2 * half + d[None, :]
        tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + half, o2.to(out_ptr.dtype.element_ty), mask=ok)


def _rotate(x_BSHD: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """The kernel over ``x`` (last dim contiguous) with tables [1 or B, S, 1, head_dim]
    (last dim contiguous); returns a new contiguous tensor."""
    if x_BSHD.stride(-1) != 1:
        x_BSHD = x_BSHD.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    batch, seq_len, heads, head_dim = x_BSHD.shape
    out = torch.empty(x_BSHD.shape, dtype=x_BSHD.dtype, device=x_BSHD.device)
    cs_stride_b = cos.stride(0) if cos.shape[0] > 1 else 0
    launch(
        _rope_kernel, (batch * seq_len,), x_BSHD, cos, sin, out, seq_len, heads, head_dim // 2,
        x_BSHD.stride(0), x_BSHD.stride(1), x_BSHD.stride(2), cs_stride_b, cos.stride(1),
        INVERSE=inverse, BLOCK_H=min(_ROPE_BLOCK_H, triton.next_power_of_2(heads)),
        BLOCK_D=triton.next_power_of_2(head_dim // 2), num_warps=4,
    )  # fmt: skip
    return out


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSHD, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x_BSHD, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad_BSHD):
        cos, sin = ctx.saved_tensors
        return _rotate(grad_BSHD, cos, sin, inverse=True), None, None


def _broadcast_cos_sin(x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    if x_BSHD.dim() != 4:
        raise ValueError(
            f"x shape ({tuple(x_BSHD.shape)}) must be [B, S, H, head_dim]; "
            "apply RoPE before transposing heads to dim 1"
        )
    head_dim = x_BSHD.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for RoPE; use an even head_dim")
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos shape ({tuple(cos.shape)}) must equal sin shape ({tuple(sin.shape)}); "
            "compute both from the same angles"
        )
    seq_len = x_BSHD.shape[1]
    if cos.dim() == 2 and cos.shape == (seq_len, head_dim):
        return cos[None, :, None, :], sin[None, :, None, :]  # [1, S, 1, head_dim]
    if cos.dim() == 3 and cos.shape[1:] == (seq_len, head_dim):
        if cos.shape[0] not in (1, x_BSHD.shape[0]):
            raise ValueError(
                f"cos shape ({tuple(cos.shape)}) has {cos.shape[0]} rows of positions but x "
                f"has batch {x_BSHD.shape[0]}; pass positions [S] or [B, S] for this batch"
            )
        return cos[:, :, None, :], sin[:, :, None, :]  # [B, S, 1, head_dim]
    raise ValueError(
        f"cos shape ({tuple(cos.shape)}) must be [S, head_dim] = [{seq_len}, {head_dim}] "
        f"or [B, S, head_dim]; compute cos/sin for the positions of x"
    )


def apply_rope(x_BSHD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate ``x`` by the angles whose cosines and sines are given.

    Args:
        x_BSHD: Queries or keys of shape [B, S, H, head_dim].
        cos_SD: Cosines of shape [S, head_dim] or [B, S, head_dim], each frequency twice
            (halves duplicated).
        sin_SD: Sines, same shape as ``cos_SD``.

    Returns:
        Rotated tensor of the shape and dtype of ``x_BSHD``.
    """
    fused = use_kernels(x_BSHD, cos_SD, sin_SD) and x_BSHD.dtype in KERNEL_DTYPES
    if not fused or cos_SD.requires_grad or sin_SD.requires_grad:
        return apply_rope_reference(x_BSHD, cos_SD, sin_SD)
    cos, sin = _broadcast_cos_sin(x_BSHD, cos_SD, sin_SD)
    return _RopeFn.apply(x_BSHD, cos, sin)


def apply_rope_reference(x_BSHD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Plain-PyTorch reference of :func:`apply_rope` (``x * cos + rotate_half(x) * sin``).

    Args:
        x_BSHD: Queries or keys of shape [B, S, H, head_dim].
        cos_SD: Cosines of shape [S, head_dim] or [B, S, head_dim].
        sin_SD: Sines, same shape as ``cos_SD``.

    Returns:
        Rotated tensor of the shape and dtype of ``x_BSHD``.
    """
    cos, sin = _broadcast_cos_sin(x_BSHD, cos_SD, sin_SD)
    dtype = compute_dtype(x_BSHD.dtype)
    x = x_BSHD.to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.to(dtype) + rotated * sin.to(dtype)).to(x_BSHD.dtype)


def _kernel_function_for_test():
    """``apply_rope`` through the kernel on any device (the interpreter on CPU)."""

    def rope_kernel(x_BSHD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
        cos, sin = _broadcast_cos_sin(x_BSHD, cos_SD, sin_SD)
        return _RopeFn.apply(x_BSHD, cos, sin)

    return rope_kernel
