"""RMSNorm module over the last dim (Hugging Face ``Qwen3RMSNorm`` semantics via mt-ops)."""

import torch
from torch import Tensor, nn

from mt_ops import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel scale ``weight`` [dim].

    Args:
        dim: Size of the normalized (last) dim.
        eps: Added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # set by init_weights (ones)

    def forward(self, x: Tensor) -> Tensor:
        """Normalizes ``x`` [..., dim]; returns the dtype of ``x``."""
        return rms_norm(x, self.weight, self.eps)
