"""FP8 SwiGLU expert MLP, ``down(swiglu(gate(x), up(x)))``, with quantization fused into neighbours.

Legend: R routed rows (grouped by expert), D model dim, F expert hidden dim, E experts.

Composed from three :class:`~mt_ops.fp8_linear.FP8GroupedLinear` calls and
:func:`~mt_ops.swiglu.swiglu`, one training step makes six quantization passes over
activations and gradients (x twice, once per projection that reads it; h; dy; dgate; dup),
writes the SwiGLU output and both SwiGLU gradients in BF16 only to read them back for
quantization, and adds the gate and up input gradients in a seventh pass. This op runs
the same products with:

- x quantized once (rows for the gate and up fprop, token tiles for both wgrads);
- the SwiGLU fused with the quantization of its output
  (:func:`~mt_ops.fp8_swiglu.swiglu_quantize_1x128`); its backward quantizes both
  gradients through :func:`~mt_ops.fp8_swiglu.swiglu_backward_quantize_1x128` (on the H200
  a SwiGLU backward pass plus two quantizations beat the one-pass kernel, see its config);
- the gate and up input gradients summed inside one GEMM
  (:func:`~mt_ops.fp8_gemm.fp8_grouped_gemm_sum`).

Weights come from each projection's :class:`~mt_ops.fp8_linear.FP8WeightCache` (or are
quantized per call without one), and a projection's ``wgrad_queue`` defers its weight
gradient exactly as in ``FP8GroupedLinear``. Forward output and weight gradients equal the
unfused composition's bit for bit on GPU; the input gradient differs only by its single
rounding (fp32 sum, then BF16, instead of two BF16 products added).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mt_ops.deferred_wgrad import accumulate_grad
from mt_ops.fp8_gemm import fp8_grouped_gemm, fp8_grouped_gemm_sum, fp8_grouped_wgrad
from mt_ops.fp8_linear import FP8GroupedLinear, QuantizedWeight, _weight_source
from mt_ops.fp8_quant import Fp8Quantized, RowTiles, quantize_1x128_dual, row_tiles
from mt_ops.fp8_swiglu import swiglu_backward_quantize_1x128, swiglu_quantize_1x128
from mt_ops.swiglu import swiglu

__all__ = ["fp8_swiglu_experts", "fp8_swiglu_experts_reference", "grouped_swiglu_mlp"]


@dataclass(frozen=True)
class _Projections:
    """The three projections of one call (kept out of autograd's tensor inputs)."""

    gate: FP8GroupedLinear
    up: FP8GroupedLinear
    down: FP8GroupedLinear

    def quantized(self, module: FP8GroupedLinear) -> QuantizedWeight:
        # The modules' own source: the cache (its scale format checked) or a fresh quantization.
        return _weight_source(module.weight_cache, module.scale_format)(module.weight)


def _weight_grad(param: Tensor, queue, compute) -> Tensor | None:
    """Returns dW now, or defers it into the queue the projection had at forward time
    (then autograd gets None), as ``FP8GroupedLinear`` does."""
    if queue is None:
        return compute().view(param.shape)
    queue.push(lambda: accumulate_grad(param, compute().view(param.shape)))
    return None


class _FP8SwiGLUExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_gate, w_up, w_down, counts_E, projs):
        down = projs.down
        fmt, backend = down.scale_format, down.backend
        qgate, qup, qdown = (projs.quantized(m) for m in (projs.gate, projs.up, down))
        tiles = row_tiles(counts_E, x_RD.shape[0])
        x_q, x_qt = quantize_1x128_dual(x_RD, tiles=tiles, scale_format=fmt)  # once for both
        gate_RF = fp8_grouped_gemm(x_q, qgate.blocks, tiles, out_dtype=x_RD.dtype, backend=backend)
        up_RF = fp8_grouped_gemm(x_q, qup.blocks, tiles, out_dtype=x_RD.dtype, backend=backend)
        h_q, h_qt = swiglu_quantize_1x128(gate_RF, up_RF, tiles=tiles, scale_format=fmt)
        y_RD = fp8_grouped_gemm(h_q, qdown.blocks, tiles, out_dtype=x_RD.dtype, backend=backend)
        ctx.save_for_backward(
            gate_RF, up_RF, x_qt.data, x_qt.scale, h_qt.data, h_qt.scale,
            tiles.start_T, tiles.end_T, tiles.group_T, tiles.group_first_tile_G,
        )  # fmt: skip
        ctx.num_rows, ctx.projs, ctx.qweights = x_RD.shape[0], projs, (qgate, qup, qdown)
        # Parameters and wgrad queues as of forward (a schedule may swap queues before backward).
        ctx.wgrad_targets = [(m.weight, m.wgrad_queue) for m in (projs.gate, projs.up, down)]
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        gate_RF, up_RF, x_data, x_scale, h_data, h_scale, *tile_fields = ctx.saved_tensors
        tiles = RowTiles(*tile_fields, ctx.num_rows)
        projs, (qgate, qup, qdown) = ctx.projs, ctx.qweights
        fmt, backend = projs.down.scale_format, projs.down.backend
        x_qt, h_qt = Fp8Quantized(x_data, x_scale), Fp8Quantized(h_data, h_scale)
        dy_q, dy_qt = quantize_1x128_dual(dy_RD.contiguous(), tiles=tiles, scale_format=fmt)
        dh_RF = fp8_grouped_gemm(
            dy_q, qdown.transposed, tiles, out_dtype=gate_RF.dtype, backend=backend
        )
        (dgate_q, dgate_qt), (dup_q, dup_qt) = swiglu_backward_quantize_1x128(
            dh_RF, gate_RF, up_RF, tiles=tiles, scale_format=fmt
        )
        del dh_RF
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grouped_gemm_sum(
                dgate_q, qgate.transposed, dup_q, qup.transposed, tiles,
                out_dtype=gate_RF.dtype, backend=backend,
            )  # fmt: skip
        grads = []
        for (param, queue), needed, a_t, b_t in zip(
            ctx.wgrad_targets,
            ctx.needs_input_grad[1:4],
            (dgate_qt, dup_qt, dy_qt),
            (x_qt, x_qt, h_qt),
            strict=True,
        ):

            def compute(a_t=a_t, b_t=b_t, dtype=param.dtype) -> Tensor:
                return fp8_grouped_wgrad(a_t, b_t, tiles, out_dtype=dtype, backend=backend)

            grads.append(_weight_grad(param, queue, compute) if needed else None)
        return grad_x, *grads, None, None


def _autocast_input(x: Tensor) -> Tensor:
    """Under autocast the op takes and returns the autocast dtype (as FP8GroupedLinear)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def _check(x_RD, tokens_per_expert_E, gate_proj, up_proj, down_proj) -> None:
    for name, m in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if not isinstance(m, FP8GroupedLinear) or m.bias is not None:
            raise ValueError(
                f"{name} ({type(m).__name__}, bias={getattr(m, 'bias', None) is not None}) "
                "must be an FP8GroupedLinear without bias; convert the experts with "
                "convert_to_fp8, or compose the modules for biased experts"
            )
    shapes = [tuple(m.weight.shape) for m in (gate_proj, up_proj, down_proj)]
    num_experts, hidden, dim = shapes[0]
    if shapes[1] != shapes[0] or shapes[2] != (num_experts, dim, hidden):
        raise ValueError(
            f"weight shapes {shapes} must be gate/up [E, F, D] and down [E, D, F]; pass "
            "gate_proj, up_proj, down_proj in that order"
        )
    settings = {(m.scale_format, m.backend) for m in (gate_proj, up_proj, down_proj)}
    if len(settings) != 1:
        raise ValueError(
            f"projections' (scale_format, backend) {sorted(settings, key=str)} must agree; "
            "convert all three with the same convert_to_fp8 call"
        )
    if x_RD.dim() != 2 or x_RD.shape[1] != dim or tokens_per_expert_E.shape != (num_experts,):
        raise ValueError(
            f"x shape ({tuple(x_RD.shape)}) and tokens_per_expert shape "
            f"({tuple(tokens_per_expert_E.shape)}) must be [R, {dim}] and [{num_experts}]"
        )


def fp8_swiglu_experts(
    x_RD: Tensor,
    tokens_per_expert_E: Tensor,
    gate_proj: FP8GroupedLinear,
    up_proj: FP8GroupedLinear,
    down_proj: FP8GroupedLinear,
) -> Tensor:
    """``down_proj(swiglu(gate_proj(x), up_proj(x)))`` in FP8 with fused quantization.

    Args:
        x_RD: Rows grouped by expert, in expert order [R, D].
        tokens_per_expert_E: Rows per expert [E], summing to R.
        gate_proj: Gate projection, weight [E, F, D], no bias.
        up_proj: Up projection, weight [E, F, D], no bias.
        down_proj: Down projection, weight [E, D, F], no bias; the three share scale format
            and backend, and each brings its own weight cache and wgrad queue.

    Returns:
        ``y`` [R, D] in the dtype of ``x_RD`` (the autocast dtype under autocast).
    """
    _check(x_RD, tokens_per_expert_E, gate_proj, up_proj, down_proj)
    projs = _Projections(gate_proj, up_proj, down_proj)
    return _FP8SwiGLUExpertsFn.apply(
        _autocast_input(x_RD).contiguous(), gate_proj.weight, up_proj.weight, down_proj.weight,
        tokens_per_expert_E, projs,
    )  # fmt: skip


def fp8_swiglu_experts_reference(
    x_RD: Tensor,
    tokens_per_expert_E: Tensor,
    gate_proj: FP8GroupedLinear,
    up_proj: FP8GroupedLinear,
    down_proj: FP8GroupedLinear,
) -> Tensor:
    """Reference of :func:`fp8_swiglu_experts`: the unfused composition of the modules."""
    _check(x_RD, tokens_per_expert_E, gate_proj, up_proj, down_proj)
    gate_RF = gate_proj(x_RD, tokens_per_expert_E)
    up_RF = up_proj(x_RD, tokens_per_expert_E)
    return down_proj(swiglu(gate_RF, up_RF), tokens_per_expert_E)


def grouped_swiglu_mlp(
    x_RD: Tensor,
    tokens_per_expert_E: Tensor,
    gate_proj: torch.nn.Module,
    up_proj: torch.nn.Module,
    down_proj: torch.nn.Module,
) -> Tensor:
    """``down_proj(swiglu(gate_proj(x), up_proj(x)))`` for any kind of grouped linears.

    Model files call this, so they stay dtype-agnostic: when ``convert_to_fp8`` has made
    all three projections bias-free :class:`FP8GroupedLinear` modules it runs
    :func:`fp8_swiglu_experts` (quantization fused into its neighbours); otherwise it
    composes the modules (BF16 ``GroupedLinear``, or FP8 with biases). The fused path
    reads the projections' parameters without calling them, so hooks registered on the
    projections themselves do not fire (FSDP wraps the experts module, which is fine).

    Args:
        x_RD: Rows grouped by expert, in expert order [R, D].
        tokens_per_expert_E: Rows per expert [E], summing to R.
        gate_proj: Gate projection (called as ``gate_proj(x_RD, tokens_per_expert_E)``).
        up_proj: Up projection.
        down_proj: Down projection.

    Returns:
        ``y`` [R, D].
    """
    projections = (gate_proj, up_proj, down_proj)
    if all(isinstance(m, FP8GroupedLinear) and m.bias is None for m in projections):
        return fp8_swiglu_experts(x_RD, tokens_per_expert_E, *projections)
    gate_RF = gate_proj(x_RD, tokens_per_expert_E)
    up_RF = up_proj(x_RD, tokens_per_expert_E)
    return down_proj(swiglu(gate_RF, up_RF), tokens_per_expert_E)
