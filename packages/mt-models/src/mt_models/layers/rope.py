"""Rotary position embedding with Hugging Face's scalings (default, linear, YaRN).

Legend: B batch, S sequence, Dr rotary dims.

No buffers: the tables are computed on the fly in fp32 from the token positions (S × Dr/2
angles, negligible next to attention), so nothing needs re-initializing after a meta-device
build, and any positions work (context-parallel slices, packed documents restarting at 0).

``rope_scaling`` is the Hub's dict (``{"rope_type" | "type": "yarn", "factor": ...}``); the
YaRN rules follow ``transformers.modeling_rope_utils`` exactly: the frequency ramp between
``beta_fast`` and ``beta_slow`` rotations (bounds floored/ceiled unless ``truncate`` is
false, GPT-OSS), and the cos/sin multiplier ``attention_factor`` (given, or
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
``mscale(factor)``, with ``mscale(s, m) = 0.1 · m · ln(s) + 1`` for s > 1). DeepSeek also
multiplies its softmax scale by ``mscale(factor, mscale_all_dim)²``:
:func:`yarn_softmax_scale_factor`.
"""

import math

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def rope_type_of(rope_scaling: dict | None) -> str:
    """The RoPE type named by a Hub ``rope_scaling`` dict (``"default"`` for None)."""
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; use one of "
            f"{SUPPORTED_ROPE_TYPES} (or drop rope_scaling for plain RoPE)"
        )
    return rope_type


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(rope_scaling: dict | None) -> float:
    """DeepSeek's correction of the softmax scale under YaRN: ``mscale(factor, mscale_all_dim)²``.

    Args:
        rope_scaling: The Hub ``rope_scaling`` dict, or None.

    Returns:
        The multiplier of ``1 / sqrt(qk_head_dim)`` (1.0 without YaRN or mscale_all_dim).
    """
    if rope_type_of(rope_scaling) == "default":
        return 1.0
    mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
    if not mscale_all_dim:
        return 1.0
    return _mscale(rope_scaling["factor"], mscale_all_dim) ** 2


def rope_frequencies(
    dim: int, theta: float, rope_scaling: dict | None, max_position_embeddings: int
) -> tuple[Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier of a RoPE configuration.

    Args:
        dim: Dr, rotary dims (even).
        theta: ``rope_theta``.
        rope_scaling: The Hub ``rope_scaling`` dict, or None.
        max_position_embeddings: Used when YaRN's dict lacks ``factor`` or
            ``original_max_position_embeddings``.

    Returns:
        ``(inv_freq [Dr/2] fp32 on CPU, attention_factor)``.
    """
    rope_type = rope_type_of(rope_scaling)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [Dr/2]
    pos_freqs = theta**exponents
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type == "linear":
        return 1.0 / (pos_freqs * rope_scaling["factor"]), 1.0
    original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = rope_scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = rope_scaling.get("attention_factor")
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty range
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation_weight = 1 - ramp  # [Dr/2]: 1 keeps the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of RoPE for given positions.

    Args:
        dim: Dr, rotary dims (even).
        theta: The RoPE base (``rope_theta``).
        rope_scaling: The Hub ``rope_scaling`` dict (YaRN, linear) or None.
        max_position_embeddings: The config's ``max_position_embeddings``.
    """

    def __init__(
        self,
        dim: int,
        theta: float,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 4096,
    ):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim ({dim}) must be even for RoPE")
        self.dim = dim
        inv_freq, self.attention_factor = rope_frequencies(
            dim, theta, rope_scaling, max_position_embeddings
        )
        # Not a buffer: ``to_empty`` after a meta build would leave it uninitialized.
        self._inv_freq_by_device = {torch.device("cpu"): inv_freq}

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Computes the tables for the given positions.

        Args:
            position_ids: Token positions, int64 [S] or [B, S].

        Returns:
            ``(cos, sin)``, fp32 [S, Dr] or [B, S, Dr], each frequency twice (halves
            duplicated, Hugging Face's layout), times the scaling's attention factor.
        """
        device = position_ids.device
        if device not in self._inv_freq_by_device:
            cpu = self._inv_freq_by_device[torch.device("cpu")]
            self._inv_freq_by_device[device] = cpu.to(device)
        inv_freq = self._inv_freq_by_device[device]  # [Dr/2]
        angles = position_ids.float()[..., None] * inv_freq  # [..., S, Dr/2]
        emb = torch.cat((angles, angles), dim=-1)  # [..., S, Dr]
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def deinterleave(x: Tensor) -> Tensor:
    """Reorders the last dim from pairs ``(x0, x1), (x2, x3), ...`` to halves ``(x0, x2, ...,
    x1, x3, ...)``.

    DeepSeek rotates adjacent pairs; Hugging Face's other models rotate halves. Applying this
    same permutation to q's and k's rotary dims leaves every q·k unchanged, so attention
    with interleaved RoPE equals attention with half-split RoPE on de-interleaved q and k.

    Args:
        x: Tensor [..., Dr].

    Returns:
        The permuted tensor [..., Dr].
    """
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
