"""Rotary position embedding: the cos/sin tables for positions 0..S-1.

No buffers: the tables are computed on the fly in fp32 (S × head_dim/2 angles, negligible
next to attention), so nothing needs re-initializing after a meta-device build.
"""

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of RoPE with ``inv_freq[i] = theta ** (-2i / head_dim)``.

    Args:
        head_dim: Size of each attention head (even).
        theta: The RoPE base (``rope_theta``).
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim ({head_dim}) must be even for RoPE")
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Computes the tables for positions ``0..seq_len-1``.

        Args:
            seq_len: S.
            device: Where the tables live.

        Returns:
            ``(cos_SD, sin_SD)``, fp32 [S, head_dim], each frequency twice (halves
            duplicated, Hugging Face's non-interleaved layout).
        """
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))  # [head_dim/2]
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)  # [S]
        angles = torch.outer(positions, inv_freq)  # [S, head_dim/2]
        emb = torch.cat((angles, angles), dim=-1)  # [S, head_dim]
        return emb.cos(), emb.sin()
