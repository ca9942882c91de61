"""RMSNorm: ``x / sqrt(mean(x**2) + eps) * weight`` over the last dim.

Eager PyTorch runs this as four or five kernels (square, mean, add, rsqrt, two
multiplies) and, for a bf16 input, materializes an fp32 copy of ``x`` in between, so a
norm costs several round trips through memory for what is one read and one write. A fused
kernel (later) reads ``x`` once, keeps the per-row sum of squares in registers and saves
only ``rstd`` (one fp32 per row) for the backward.

Semantics follow Hugging Face's ``Qwen3RMSNorm``: normalize in fp32, cast back to the
input dtype, then multiply by the weight. The result has the dtype of ``x``. For now the
public op uses ``torch.nn.functional.rms_norm`` (a native fused path on recent PyTorch).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["rms_norm", "rms_norm_reference"]


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight shape ({tuple(weight.shape)}) must be [D] with D = x.shape[-1] "
            f"({x.shape[-1]}); pass a 1-D weight of the normalized dim"
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Root-mean-square normalization over the last dim, computed in fp32.

    Args:
        x: Input of shape [..., D], any float dtype.
        weight: Per-channel scale of shape [D].
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        Tensor of the shape and dtype of ``x``.
    """
    _check(x, weight)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Plain-PyTorch reference of :func:`rms_norm` (Hugging Face ``Qwen3RMSNorm``).

    Args:
        x: Input of shape [..., D], any float dtype.
        weight: Per-channel scale of shape [D].
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        Tensor of the shape and dtype of ``x``.
    """
    _check(x, weight)
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)
