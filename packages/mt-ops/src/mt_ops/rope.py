"""Rotary position embedding (RoPE), Hugging Face's non-interleaved convention.

The head dim is split into two halves ``(x1, x2)``; each pair ``(x1[i], x2[i])`` is
rotated by the angle of frequency ``i``: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)`` and ``cos``/``sin`` holding each frequency twice
(``cat(freqs, freqs)``). Eager PyTorch runs a slice, a negation, a concatenation and
three elementwise kernels per call, each a trip through memory; a fused kernel (later)
rotates q and k in one pass, in place.

Both ops compute in fp32 and return the dtype of ``x``.
"""

import torch
from torch import Tensor

__all__ = ["apply_rope", "apply_rope_reference"]


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
    return apply_rope_reference(x_BSHD, cos_SD, sin_SD)


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
    x = x_BSHD.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.float() + rotated * sin.float()).to(x_BSHD.dtype)
