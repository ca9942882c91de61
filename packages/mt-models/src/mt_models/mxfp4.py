"""MXFP4 (OCP microscaling FP4) dequantization of GPT-OSS expert weights.

The Hub's GPT-OSS files store each expert matrix [E, O, I] as ``<name>_blocks``, uint8
[E, O, I/32, 16] (two FP4 E2M1 codes per byte, the low nibble first), and
``<name>_scales``, uint8 [E, O, I/32] (one power-of-two exponent per block of 32 values,
biased by 127). Value = ``FP4_E2M1[code] · 2^(scale − 127)``.
"""

import torch
from torch import Tensor

# FP4 E2M1 code → value: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_TABLE = FP4_E2M1_VALUES + tuple(-v for v in FP4_E2M1_VALUES)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Dequantizes MXFP4 blocks and scales.

    Args:
        blocks: uint8 [..., G, B] packed codes (2·B values per block).
        scales: uint8 [..., G] biased exponents.
        dtype: Output dtype.

    Returns:
        Tensor [..., G · 2B] in ``dtype`` (exact: every value is a power of two times a
        1.5-bit mantissa).
    """
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"blocks shape ({tuple(blocks.shape)}) must be scales shape "
            f"({tuple(scales.shape)}) plus one dim of packed bytes"
        )
    table = torch.tensor(FP4_E2M1_TABLE, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    low, high = table[codes & 0x0F], table[codes >> 4]  # [..., G, B] each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 2B], low nibble first
    exponent = scales.to(torch.int32) - SCALE_BIAS  # [..., G]
    values = torch.ldexp(values, exponent[..., None].float())
    return values.flatten(-2).to(dtype)  # [..., G·2B]
