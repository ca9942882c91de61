"""Grouped-query self-attention with per-head QK-norm (Qwen3) and RoPE.

Legend: B batch, S sequence, D model dim, H query heads, G key/value heads, Dh head dim.
"""

from torch import Tensor, nn

from mt_models.layers.linear import Linear
from mt_models.layers.norm import RMSNorm
from mt_ops import apply_rope, attention


class GQAAttention(nn.Module):
    """Causal self-attention; q and k are RMS-normed over the head dim before RoPE.

    Args:
        hidden_size: D.
        num_heads: H, query heads.
        num_kv_heads: G, key/value heads (divides H).
        head_dim: Dh.
        eps: Epsilon of the QK-norms.
        bias: Whether the q/k/v/o projections carry a bias.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        bias: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x_BSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
        """Attends causally over the sequence.

        Args:
            x_BSD: Normed input [B, S, D].
            cos_SD: RoPE cosines [S, Dh].
            sin_SD: RoPE sines [S, Dh].

        Returns:
            Attention output projected back to [B, S, D].
        """
        batch, seq_len, _ = x_BSD.shape
        q_BSHD = self.q_norm(self.q_proj(x_BSD).view(batch, seq_len, self.num_heads, -1))
        k_BSGD = self.k_norm(self.k_proj(x_BSD).view(batch, seq_len, self.num_kv_heads, -1))
        v_BSGD = self.v_proj(x_BSD).view(batch, seq_len, self.num_kv_heads, -1)
        q_BSHD = apply_rope(q_BSHD, cos_SD, sin_SD)
        k_BSGD = apply_rope(k_BSGD, cos_SD, sin_SD)
        out_BHSD = attention(
            q_BSHD.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2), causal=True
        )  # [B, H, S, Dh]
        out_BSD = out_BHSD.transpose(1, 2).reshape(batch, seq_len, -1)  # [B, S, H*Dh]
        return self.o_proj(out_BSD)
