"""The dtype rule of ops whose tensor arguments meet in one matmul or attention call.

Outside autocast such arguments must share a dtype: PyTorch's matmul and SDPA refuse a
bf16 activation against an fp32 weight with an error that names neither argument nor fix,
and an op that upcasts everything (a reference) would silently accept it. Under
``torch.autocast`` for the tensors' device the check is skipped: there matmul and SDPA cast
their floating inputs to the autocast dtype (``grouped_linear`` casts explicitly), which
is how one-GPU training runs bf16 activations against fp32 parameters.
"""

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

__all__ = [
    "KERNEL_DTYPES",
    "autocast_dtype",
    "autocast_off",
    "check_same_dtype",
    "compute_dtype",
    "is_integer",
]

# What the Triton kernels take: they compute in fp32, so other dtypes (fp64) take the
# eager op or reference, which keeps them.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device``'s type, else None.

    A custom autograd Function sees no autocast, so ops that wrap one cast their inputs to
    this dtype themselves. Devices without autocast (meta) give None, where
    ``torch.is_autocast_enabled`` would raise.
    """
    device_type = device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device: torch.device) -> AbstractContextManager:
    """A context with autocast off for ``device``'s type, for references that promise fp32
    math (their matmuls would run in the autocast dtype); a no-op for devices without
    autocast (meta), where ``torch.autocast`` would raise."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in for inputs of ``dtypes``: fp32, or fp64 when any
    is fp64 (which fp32 would round, failing gradcheck)."""
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


def is_integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (ids, counts, positions): not float, complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_same_dtype(expected: tuple[str, Tensor], *others: tuple[str, Tensor | None]) -> None:
    """Raises ``ValueError`` unless the others have the dtype of ``expected`` or autocast is on.

    Costs a dtype comparison per tensor (no device work); only on a mismatch does it ask
    whether autocast is on for the device of ``expected``.

    Args:
        expected: ``(argument name, tensor)`` whose dtype the others must have (the weight).
        *others: ``(argument name, tensor)`` pairs; a None tensor (an absent bias) is skipped.
    """
    expected_name, expected_t = expected
    for name, t in others:
        if t is None or t.dtype == expected_t.dtype:
            continue
        device_type = expected_t.device.type
        if autocast_dtype(expected_t.device) is not None:
            return
        raise ValueError(
            f"{name} dtype ({t.dtype}) must equal {expected_name} dtype ({expected_t.dtype}) "
            f"outside autocast; pass {name}.to({expected_name}.dtype), or call under "
            f"torch.autocast({device_type!r})"
        )
