"""GPT-OSS's clamped SwiGLU over an interleaved gate/up projection.

``gate_up[..., 0::2]`` is the gate, ``gate_up[..., 1::2]`` the up projection (GPT-OSS
stores the two interleaved in one matrix). Both are clamped to ``limit`` (the gate from
above only, up to ``[-limit, limit]``), then ``out = (up + 1) · gate · sigmoid(alpha · gate)``.

Eager PyTorch runs two strided slices, two clamps, a sigmoid and three multiplies, each a
trip through memory, and autograd saves several temporaries. The fused kernel
(``clamped_swiglu_fused`` in ``clamped_swiglu_kernel.py``) reads ``gate_up`` once, writes
``out``, and recomputes the activation in the backward.

The public op is the eager expression in fp32 (strided slices, ``clamp``); the reference
spells it out differently (pairs view, ``where``), also in fp32 (both in fp64 for fp64
inputs).
"""

import torch
from torch import Tensor

from mt_ops._dtypes import compute_dtype

__all__ = ["clamped_swiglu", "clamped_swiglu_reference"]


def _check(gate_up: Tensor, alpha: float, limit: float) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up shape ({tuple(gate_up.shape)}) must have an even last dim (gate and up "
            "interleaved); pass the output of the fused gate_up projection"
        )
    if not (alpha > 0 and limit > 0):  # (NaN fails every comparison)
        raise ValueError(
            f"alpha ({alpha}) and limit ({limit}) must be > 0 (GPT-OSS: 1.702 and 7.0)"
        )


def clamped_swiglu(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """``(clamp(up) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``.

    Args:
        gate_up: Interleaved gate/up projection [..., 2F] (gate at even, up at odd indices).
        alpha: Slope inside the sigmoid (``swiglu_alpha``).
        limit: Clamp bound (``swiglu_limit``).

    Returns:
        Tensor [..., F] in the dtype of ``gate_up``.
    """
    _check(gate_up, alpha, limit)
    x = gate_up.to(compute_dtype(gate_up.dtype))  # bf16 intermediates would round five times
    gate = x[..., 0::2].clamp(max=limit)  # [..., F]
    up = x[..., 1::2].clamp(min=-limit, max=limit)  # [..., F]
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(gate_up.dtype)


def clamped_swiglu_reference(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """Plain-PyTorch fp32 (fp64 for fp64 inputs) reference of :func:`clamped_swiglu`.

    Args:
        gate_up: Interleaved gate/up projection [..., 2F] (gate at even, up at odd indices).
        alpha: Slope inside the sigmoid (``swiglu_alpha``).
        limit: Clamp bound (``swiglu_limit``).

    Returns:
        Tensor [..., F] in the dtype of ``gate_up``.
    """
    _check(gate_up, alpha, limit)
    pairs = gate_up.to(compute_dtype(gate_up.dtype)).unflatten(-1, (-1, 2))  # [..., F, 2]
    gate, up = pairs[..., 0], pairs[..., 1]
    # Values at the bound keep their gradient (as ``clamp``); beyond it they lose it.
    gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    up = torch.where(up.abs() > limit, torch.sign(up) * limit, up)
    # (gate / (1 + exp(-alpha·gate)) overflows exp below gate ≈ -52 in fp32: a NaN gradient)
    glu = gate * torch.sigmoid(alpha * gate)
    return ((up + 1) * glu).to(gate_up.dtype)
