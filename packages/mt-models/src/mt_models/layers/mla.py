"""DeepSeek multi-head latent attention (MLA), as in DeepSeek-V2.

Legend: B batch, S sequence, D model dim, H heads, Dn ``qk_nope_head_dim``, Dr
``qk_rope_head_dim``, Dv ``v_head_dim``, Lq ``q_lora_rank``, Lkv ``kv_lora_rank``.

Keys and values come from one compressed latent per token: ``kv_a_proj_with_mqa`` maps x
to ``[c_kv (Lkv), k_rope (Dr)]``; ``c_kv`` is RMS-normed and ``kv_b_proj`` expands it to
each head's ``[k_nope (Dn), v (Dv)]``. ``k_rope`` is one rotary key shared by all heads.
Queries come from ``q_proj`` or, with ``q_lora_rank``, from ``q_b_proj(norm(q_a_proj(x)))``.
RoPE rotates only the last Dr dims of q and k, in DeepSeek's interleaved pair layout.
The softmax scale is ``(Dn + Dr)^-0.5``, corrected under YaRN by
``mscale(factor, mscale_all_dim)²``.
"""

import torch
from torch import Tensor, nn

from mt_models.layers.attention import AttentionCore, LocalAttention, causal_context
from mt_models.layers.linear import Linear
from mt_models.layers.norm import RMSNorm
from mt_models.layers.rope import RotaryEmbedding, deinterleave, yarn_softmax_scale_factor
from mt_ops import apply_rope

# transformers builds MLA's latent norms with DeepseekV2RMSNorm's default eps, not
# config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """Multi-head latent attention; parameter names are the Hub's.

    Args:
        hidden_size: D.
        num_heads: H.
        q_lora_rank: Lq, or None for a plain ``q_proj``.
        kv_lora_rank: Lkv.
        qk_nope_head_dim: Dn.
        qk_rope_head_dim: Dr.
        v_head_dim: Dv.
        rotary: RoPE tables over Dr.
        rope_scaling: The Hub ``rope_scaling`` dict (for the softmax-scale correction).
        bias: ``attention_bias``: biases on ``q_a_proj``, ``kv_a_proj_with_mqa``, ``o_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: RotaryEmbedding,
        rope_scaling: dict | None = None,
        bias: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.window = None
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.rotary = rotary
        self.scale = self.qk_head_dim**-0.5 * yarn_softmax_scale_factor(rope_scaling)
        # Swapped by mt-parallel for a context-parallel core.
        self.attention_core: AttentionCore = LocalAttention()

    def forward(self, x_BSD: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Attends causally over the sequence.

        Args:
            x_BSD: Normed input [B, S, D].
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            Attention output projected back to [B, S, D].
        """
        batch, seq_len, _ = x_BSD.shape
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BSD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        q_BSHK = q.view(batch, seq_len, heads, self.qk_head_dim)
        q_nope_BSHN, q_rope_BSHR = q_BSHK.split([nope, rope], -1)
        latent_BSL, k_rope_BSR = self.kv_a_proj_with_mqa(x_BSD).split(
            [self.kv_lora_rank, rope], dim=-1
        )
        kv_BSHX = self.kv_b_proj(self.kv_a_layernorm(latent_BSL)).view(
            batch, seq_len, heads, nope + self.v_head_dim
        )
        k_nope_BSHN, v_BSHV = kv_BSHX.split([nope, self.v_head_dim], dim=-1)
        # Interleaved RoPE = half-split RoPE on de-interleaved q and k (same q·k).
        rope_positions = position_ids
        if rope_positions is None:
            rope_positions = torch.arange(seq_len, device=x_BSD.device)
        cos, sin = self.rotary(rope_positions)  # [S or B,S, Dr]
        q_rope_BSHR = apply_rope(deinterleave(q_rope_BSHR), cos, sin)
        k_rope_BS1R = apply_rope(deinterleave(k_rope_BSR)[:, :, None], cos, sin)
        q_BSHK = torch.cat((q_nope_BSHN, q_rope_BSHR), dim=-1)  # [B, S, H, Dn+Dr]
        k_BSHK = torch.cat((k_nope_BSHN, k_rope_BS1R.expand(-1, -1, heads, -1)), dim=-1)
        out_BHSV = self.attention_core(
            q_BSHK.transpose(1, 2),
            k_BSHK.transpose(1, 2),
            v_BSHV.transpose(1, 2),
            positions_S=position_ids,
            scale=self.scale,
            window=None,
            sinks_H=None,
        )  # [B, H, S, Dv]
        out_BSX = out_BHSV.transpose(1, 2).reshape(batch, seq_len, heads * self.v_head_dim)
        return self.o_proj(out_BSX)

    def score_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of q·k and p·v per token: ``2 · H · (Dqk + Dv) · S/2``."""
        return (
            2
            * self.num_heads
            * (self.qk_head_dim + self.v_head_dim)
            * causal_context(seq_len, None)
        )
