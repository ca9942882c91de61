"""mt-ops: the ops of a mixture-of-experts training step, each beside a plain-PyTorch reference.

Every public op has a ``<op>_reference`` with the same signature; the public op runs a
native PyTorch fast path where one exists and the reference otherwise (fused Triton
kernels come later and keep these signatures).
"""

from mt_ops.attention import attention, attention_reference
from mt_ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from mt_ops.grouped_linear import GroupedLinear, grouped_linear, grouped_linear_reference
from mt_ops.moe_permute import DispatchPlan, permute, plan_dispatch, unpermute
from mt_ops.rms_norm import rms_norm, rms_norm_reference
from mt_ops.rope import apply_rope, apply_rope_reference
from mt_ops.swiglu import swiglu, swiglu_reference

__all__ = [
    "DispatchPlan",
    "GroupedLinear",
    "apply_rope",
    "apply_rope_reference",
    "attention",
    "attention_reference",
    "grouped_linear",
    "grouped_linear_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "permute",
    "plan_dispatch",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
    "unpermute",
]
