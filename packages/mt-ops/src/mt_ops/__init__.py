"""mt-ops: the ops of a mixture-of-experts training step, each beside a plain-PyTorch reference.

Every public op has a ``<op>_reference`` with the same signature; on CUDA the public op
runs a fused Triton kernel or a native PyTorch fast path. On CPU no kernel runs: the MoE
plan, permute/unpermute and the FP8 quantizers run their references, the FP8 GEMMs their
exact emulation, attention SDPA (the reference for sinks and LSE requests), and the other
ops the eager PyTorch their module docstrings name (SwiGLU, RMSNorm, the chunked
cross-entropy, the grouped linears' per-expert loops; the fused FP8 expert MLP its autograd
function over the emulated GEMMs). Triton's interpreter runs the kernels on CPU tensors in
tests only.
"""

from mt_ops.attention import apply_sinks, attention, attention_reference
from mt_ops.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference
from mt_ops.clamped_swiglu_kernel import clamped_swiglu_fused
from mt_ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from mt_ops.deferred_wgrad import (
    Linear,
    WeightGradQueue,
    make_weight_grads_deferrable,
    set_weight_grad_queue,
)
from mt_ops.fp8_expert_mlp import (
    fp8_moe_swiglu_experts,
    fp8_swiglu_experts,
    fp8_swiglu_experts_reference,
    grouped_swiglu_mlp,
    grouped_swiglu_moe,
)
from mt_ops.fp8_gemm import (
    fp8_backend,
    fp8_grouped_gemm,
    fp8_grouped_gemm_sum,
    fp8_grouped_gemm_sum_reference,
    fp8_grouped_wgrad,
)
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear, FP8WeightCache, convert_to_fp8
from mt_ops.fp8_quant import (
    Fp8Quantized,
    RowTiles,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_128x128,
    row_tiles,
)
from mt_ops.fp8_swiglu import (
    swiglu_backward_quantize_1x128,
    swiglu_backward_quantize_1x128_reference,
    swiglu_quantize_1x128,
    swiglu_quantize_1x128_reference,
)
from mt_ops.grouped_linear import GroupedLinear, grouped_linear, grouped_linear_reference
from mt_ops.moe_permute import (
    DispatchPlan,
    permute,
    permute_reference,
    plan_dispatch,
    plan_dispatch_reference,
    unpermute,
    unpermute_reference,
)
from mt_ops.rms_norm import rms_norm, rms_norm_reference
from mt_ops.rope import apply_rope, apply_rope_reference
from mt_ops.swiglu import swiglu, swiglu_reference

__all__ = [
    "DispatchPlan",
    "FP8GroupedLinear",
    "FP8Linear",
    "FP8WeightCache",
    "Fp8Quantized",
    "GroupedLinear",
    "Linear",
    "RowTiles",
    "WeightGradQueue",
    "clamped_swiglu_fused",
    "convert_to_fp8",
    "fp8_backend",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_sum",
    "fp8_grouped_gemm_sum_reference",
    "fp8_grouped_wgrad",
    "fp8_moe_swiglu_experts",
    "fp8_swiglu_experts",
    "fp8_swiglu_experts_reference",
    "grouped_swiglu_mlp",
    "grouped_swiglu_moe",
    "make_weight_grads_deferrable",
    "permute_reference",
    "plan_dispatch_reference",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_1x128_dual",
    "row_tiles",
    "set_weight_grad_queue",
    "unpermute_reference",
    "apply_sinks",
    "apply_rope",
    "apply_rope_reference",
    "attention",
    "attention_reference",
    "clamped_swiglu",
    "clamped_swiglu_reference",
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
    "swiglu_backward_quantize_1x128",
    "swiglu_backward_quantize_1x128_reference",
    "swiglu_quantize_1x128",
    "swiglu_quantize_1x128_reference",
    "unpermute",
]
