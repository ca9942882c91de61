"""SwiGLU activation: ``silu(gate) * up``.

Eager PyTorch computes ``silu(gate)`` into a temporary and multiplies it by ``up`` in a
second kernel, and autograd saves ``gate``, ``up`` and the temporary. A fused kernel
(later) reads ``gate`` and ``up`` once, writes the product, and recomputes ``silu`` in the
backward so only the two inputs are saved.

The public op is the eager expression; the reference spells out ``sigmoid`` in fp32.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["swiglu", "swiglu_reference"]


def _check(gate: Tensor, up: Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"gate shape ({tuple(gate.shape)}) must equal up shape ({tuple(up.shape)}); "
            "split a fused gate_up projection into two equal halves"
        )


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Gated SiLU: ``silu(gate) * up``.

    Args:
        gate: Gate projection, any shape.
        up: Up projection, same shape and dtype as ``gate``.

    Returns:
        Tensor of the shape and dtype of ``gate``.
    """
    _check(gate, up)
    return F.silu(gate) * up


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch reference of :func:`swiglu`, computed in fp32.

    Args:
        gate: Gate projection, any shape.
        up: Up projection, same shape and dtype as ``gate``.

    Returns:
        Tensor of the shape and dtype of ``gate``.
    """
    _check(gate, up)
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
