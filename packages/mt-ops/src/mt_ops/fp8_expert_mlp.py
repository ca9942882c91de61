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

:func:`fp8_moe_swiglu_experts` takes the tokens and the dispatch plan instead of routed
rows and also folds the MoE permute and unpermute in: x's quantization gathers the token
rows itself (no BF16 routed copy), and in the backward the output gradient is gathered,
weighted by the router and quantized in one pass (no BF16 routed-row gradient); the
unpermute's forward gather-sum and the top-k weight gradient stay as in ``mt_ops.unpermute``.
On the H200 (Qwen3-30B-A3B experts, 16k tokens) that removes 0.32 ms of 8.8 ms of kernels per
layer step. The models reach it through :func:`grouped_swiglu_moe` when a layer's local
dispatcher runs its phases back to back; pipeline schedules, which interleave the dispatch,
experts and combine phases of different micro-batches, and expert parallelism keep the
separate permute and unpermute.

Weights come from each projection's :class:`~mt_ops.fp8_linear.FP8WeightCache` (or are
quantized per call without one), and a projection's ``wgrad_queue`` defers its weight
gradient exactly as in ``FP8GroupedLinear``. Forward output and weight gradients equal the
unfused composition's bit for bit on GPU; the input gradient differs only by its single
rounding (fp32 sum, then BF16, instead of two BF16 products added).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mt_ops._triton import use_kernels
from mt_ops.deferred_wgrad import weight_grad_or_defer
from mt_ops.fp8_gemm import (
    fp8_grouped_gemm,
    fp8_grouped_gemm_pair,
    fp8_grouped_gemm_sum,
    fp8_grouped_wgrad,
)
from mt_ops.fp8_linear import FP8GroupedLinear, QuantizedWeight, _autocast_input, _weight_source
from mt_ops.fp8_quant import Fp8Quantized, RowTiles, quantize_1x128_dual, row_tiles
from mt_ops.fp8_swiglu import swiglu_backward_quantize_1x128, swiglu_quantize_1x128
from mt_ops.grouped_linear import _check_shapes as _check_grouped_args
from mt_ops.moe_permute import (
    DispatchPlan,
    _gather_sum,
    _unpermute_backward,
    permute,
    unpermute,
)
from mt_ops.swiglu import swiglu

__all__ = [
    "fp8_moe_swiglu_experts",
    "fp8_swiglu_experts",
    "fp8_swiglu_experts_reference",
    "grouped_swiglu_mlp",
    "grouped_swiglu_moe",
]


@dataclass(frozen=True)
class _Projections:
    """The three projections of one call (kept out of autograd's tensor inputs)."""

    gate: FP8GroupedLinear
    up: FP8GroupedLinear
    down: FP8GroupedLinear

    def quantized(self, module: FP8GroupedLinear) -> QuantizedWeight:
        # The modules' own source: the cache (its scale format checked) or a fresh quantization.
        return _weight_source(module.weight_cache, module.scale_format)(module.weight)


def _experts_forward(ctx, x_q, x_qt, tiles: RowTiles, projs: _Projections, dtype):
    """The MLP from quantized rows: returns ``(y_RD, tensors to save)``; the weights and
    wgrad targets go on ``ctx``. The saved list is what :func:`_experts_backward` takes."""
    down = projs.down
    backend = down.backend
    qgate, qup, qdown = (projs.quantized(m) for m in (projs.gate, projs.up, down))
    gate_RF, up_RF = fp8_grouped_gemm_pair(
        x_q, qgate.blocks, qup.blocks, tiles, out_dtype=dtype, backend=backend
    )
    h_q, h_qt = swiglu_quantize_1x128(gate_RF, up_RF, tiles=tiles, scale_format=down.scale_format)
    y_RD = fp8_grouped_gemm(h_q, qdown.blocks, tiles, out_dtype=dtype, backend=backend)
    ctx.num_rows, ctx.projs, ctx.qweights = tiles.num_rows, projs, (qgate, qup, qdown)
    # Parameters and wgrad queues as of forward (a schedule may swap queues before backward).
    ctx.wgrad_targets = [(m.weight, m.wgrad_queue) for m in (projs.gate, projs.up, down)]
    saved = [
        gate_RF, up_RF, x_qt.data, x_qt.scale, h_qt.data, h_qt.scale,
        tiles.start_T, tiles.end_T, tiles.group_T, tiles.group_first_tile_G,
    ]  # fmt: skip
    return y_RD, saved


def _experts_backward(ctx, saved, tiles, dy_q, dy_qt, needs_input_grad, needs_weight_grads):
    """The MLP's backward from the quantized output gradient: ``(grad_x_RD, [dW...])``."""
    gate_RF, up_RF, x_data, x_scale, h_data, h_scale = saved[:6]
    qgate, qup, qdown = ctx.qweights
    fmt, backend = ctx.projs.down.scale_format, ctx.projs.down.backend
    x_qt, h_qt = Fp8Quantized(x_data, x_scale), Fp8Quantized(h_data, h_scale)
    dh_RF = fp8_grouped_gemm(
        dy_q, qdown.transposed, tiles, out_dtype=gate_RF.dtype, backend=backend
    )
    (dgate_q, dgate_qt), (dup_q, dup_qt) = swiglu_backward_quantize_1x128(
        dh_RF, gate_RF, up_RF, tiles=tiles, scale_format=fmt
    )
    del dh_RF
    grad_x = None
    if needs_input_grad:
        grad_x = fp8_grouped_gemm_sum(
            dgate_q, qgate.transposed, dup_q, qup.transposed, tiles,
            out_dtype=gate_RF.dtype, backend=backend,
        )  # fmt: skip
    grads = []
    for (param, queue), needed, a_t, b_t in zip(
        ctx.wgrad_targets, needs_weight_grads, (dgate_qt, dup_qt, dy_qt), (x_qt, x_qt, h_qt),
        strict=True,
    ):  # fmt: skip

        def compute(a_t=a_t, b_t=b_t, param=param) -> Tensor:
            dw = fp8_grouped_wgrad(a_t, b_t, tiles, out_dtype=param.dtype, backend=backend)
            return dw.view(param.shape)

        # Now, or deferred into the queue the projection had at forward time, as
        # FP8GroupedLinear does.
        grads.append(weight_grad_or_defer(param, queue, compute) if needed else None)
    return grad_x, grads


class _FP8SwiGLUExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_gate, w_up, w_down, counts_E, projs):
        tiles = row_tiles(counts_E, x_RD.shape[0])
        fmt = projs.down.scale_format
        x_q, x_qt = quantize_1x128_dual(x_RD, tiles=tiles, scale_format=fmt)  # once for both
        y_RD, saved = _experts_forward(ctx, x_q, x_qt, tiles, projs, x_RD.dtype)
        ctx.save_for_backward(*saved)
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        saved = ctx.saved_tensors
        tiles = RowTiles(*saved[-4:], ctx.num_rows)
        fmt = ctx.projs.down.scale_format
        dy_q, dy_qt = quantize_1x128_dual(dy_RD.contiguous(), tiles=tiles, scale_format=fmt)
        grad_x, grads = _experts_backward(
            ctx, saved, tiles, dy_q, dy_qt, ctx.needs_input_grad[0], ctx.needs_input_grad[1:4]
        )
        return grad_x, *grads, None, None


class _FP8MoESwiGLUFn(torch.autograd.Function):
    """permute → experts → unpermute, the permute fused into x's quantization and the
    unpermute's backward into dy's."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, w_gate, w_up, w_down, plan, projs):
        # x's dtype, kept for its gradient (fp32 tokens under autocast: the K rows of each
        # token are summed into fp32, as permute's backward does after the MLP's cast).
        ctx.x_dtype = x_TD.dtype
        x_TD = _autocast_input(x_TD).contiguous()
        tiles = row_tiles(plan.tokens_per_expert_E, plan.num_tokens * plan.topk)
        fmt = projs.down.scale_format
        x_q, x_qt = quantize_1x128_dual(
            x_TD, tiles=tiles, scale_format=fmt, source_rows=plan.sorted_token_ids_R
        )
        y_RD, saved = _experts_forward(ctx, x_q, x_qt, tiles, projs, x_TD.dtype)
        ctx.plan = plan
        ctx.save_for_backward(*saved, y_RD, weights_TK)
        return _gather_sum(y_RD, plan, weights_TK)

    @staticmethod
    def backward(ctx, dout_TD):
        *saved, y_RD, weights_TK = ctx.saved_tensors
        plan, dout_TD = ctx.plan, dout_TD.contiguous()
        tiles = RowTiles(*saved[-4:], ctx.num_rows)
        # Routed row r's gradient is w[slot of r] · dout[token of r] (unpermute's backward).
        row_weights_R = weights_TK.reshape(-1).index_select(0, plan.sorted_slot_R)
        dy_q, dy_qt = quantize_1x128_dual(
            dout_TD, tiles=tiles, scale_format=ctx.projs.down.scale_format,
            source_rows=plan.sorted_token_ids_R, row_weights=row_weights_R,
        )  # fmt: skip
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _unpermute_backward(dout_TD, y_RD, plan, weights_TK, grad_y=False)[1]
        del y_RD
        grad_x_RD, grads = _experts_backward(
            ctx, saved, tiles, dy_q, dy_qt, ctx.needs_input_grad[0], ctx.needs_input_grad[2:5]
        )
        grad_x = None if grad_x_RD is None else _gather_sum(grad_x_RD, plan, out_dtype=ctx.x_dtype)
        return grad_x, grad_w, *grads, None, None


def _check(x_RD, tokens_per_expert_E, gate_proj, up_proj, down_proj, num_rows=None) -> None:
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
    # Integer counts; on the host also >= 0 and summing to the routed rows.
    _check_grouped_args(x_RD, gate_proj.weight, tokens_per_expert_E, num_rows=num_rows)


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


def fp8_moe_swiglu_experts(
    x_TD: Tensor,
    plan: DispatchPlan,
    topk_weights_TK: Tensor,
    gate_proj: FP8GroupedLinear,
    up_proj: FP8GroupedLinear,
    down_proj: FP8GroupedLinear,
) -> Tensor:
    """``unpermute(fp8_swiglu_experts(permute(x), ...), plan, topk_weights)``, the permute
    fused into the quantization of x and the unpermute's backward into that of dy.

    A BF16 permute writes the routed rows [R, D] that the MLP then reads to quantize; here
    the quantization gathers the token rows itself and writes only the FP8 copies (as many
    bytes as the permute alone). In the backward the output gradient is gathered, weighted
    and quantized in one pass, without the routed-row gradient in BF16. The result and every
    gradient equal those of ``permute`` → :func:`fp8_swiglu_experts` → ``unpermute`` on GPU
    bit for bit (under autocast too: fp32 tokens get an fp32 gradient summed in fp32).

    Args:
        x_TD: Token activations [T, D].
        plan: The :func:`~mt_ops.moe_plan.plan_dispatch` plan of these tokens.
        topk_weights_TK: Router weight of each token's k-th expert [T, K].
        gate_proj: Gate projection, weight [E, F, D], no bias.
        up_proj: Up projection, weight [E, F, D], no bias.
        down_proj: Down projection, weight [E, D, F], no bias.

    Returns:
        ``out[t] = Σ_k w[t, k] · expert_k(x[t])``, [T, D] in the dtype of ``x_TD`` (the
        autocast dtype under autocast).
    """
    num_rows = plan.num_tokens * plan.topk
    _check(x_TD, plan.tokens_per_expert_E, gate_proj, up_proj, down_proj, num_rows)
    if x_TD.shape[0] != plan.num_tokens or tuple(topk_weights_TK.shape) != (
        plan.num_tokens,
        plan.topk,
    ):
        raise ValueError(
            f"x shape ({tuple(x_TD.shape)}) and topk_weights shape "
            f"({tuple(topk_weights_TK.shape)}) must be [T, D] and [T, K] with T = "
            f"{plan.num_tokens}, K = {plan.topk}; pass the tokens the plan was made for"
        )
    if not use_kernels(x_TD, topk_weights_TK) or plan.num_tokens * plan.topk == 0:
        return _composed_moe(x_TD, plan, topk_weights_TK, (gate_proj, up_proj, down_proj))
    projs = _Projections(gate_proj, up_proj, down_proj)
    return _FP8MoESwiGLUFn.apply(
        x_TD, topk_weights_TK.contiguous(), gate_proj.weight, up_proj.weight,
        down_proj.weight, plan, projs,
    )  # fmt: skip


def _composed_mlp(x_RD, tokens_per_expert_E, projections) -> Tensor:
    """``down(swiglu(gate(x), up(x)))`` through the modules themselves (no fusion)."""
    gate_proj, up_proj, down_proj = projections
    gate_RF = gate_proj(x_RD, tokens_per_expert_E)
    up_RF = up_proj(x_RD, tokens_per_expert_E)
    return down_proj(swiglu(gate_RF, up_RF), tokens_per_expert_E)


def _composed_moe(x_TD, plan, topk_weights_TK, projections) -> Tensor:
    """permute → :func:`grouped_swiglu_mlp` (fused for FP8 projections) → unpermute."""
    y_RD = grouped_swiglu_mlp(permute(x_TD, plan), plan.tokens_per_expert_E, *projections)
    return unpermute(y_RD, plan, topk_weights_TK)


def _fusable(projections) -> bool:
    """Whether the fused FP8 ops can run these projections: bias-free FP8 grouped linears."""
    return all(isinstance(m, FP8GroupedLinear) and m.bias is None for m in projections)


def grouped_swiglu_moe(
    x_TD: Tensor,
    plan: DispatchPlan,
    topk_weights_TK: Tensor,
    gate_proj: torch.nn.Module,
    up_proj: torch.nn.Module,
    down_proj: torch.nn.Module,
) -> Tensor:
    """permute → :func:`grouped_swiglu_mlp` → unpermute, for any kind of grouped linears.

    Runs :func:`fp8_moe_swiglu_experts` (permute and unpermute fused with quantization)
    when all three projections are bias-free :class:`FP8GroupedLinear` modules; otherwise
    composes :func:`~mt_ops.moe_permute.permute`, :func:`grouped_swiglu_mlp` and
    :func:`~mt_ops.moe_permute.unpermute`.

    Args:
        x_TD: Token activations [T, D].
        plan: The :func:`~mt_ops.moe_plan.plan_dispatch` plan of these tokens.
        topk_weights_TK: Router weight of each token's k-th expert [T, K].
        gate_proj: Gate projection (called as ``gate_proj(x_RD, tokens_per_expert_E)``).
        up_proj: Up projection.
        down_proj: Down projection.

    Returns:
        ``out`` [T, D].
    """
    projections = (gate_proj, up_proj, down_proj)
    if _fusable(projections):
        return fp8_moe_swiglu_experts(x_TD, plan, topk_weights_TK, *projections)
    return _composed_moe(x_TD, plan, topk_weights_TK, projections)


def fp8_swiglu_experts_reference(
    x_RD: Tensor,
    tokens_per_expert_E: Tensor,
    gate_proj: FP8GroupedLinear,
    up_proj: FP8GroupedLinear,
    down_proj: FP8GroupedLinear,
) -> Tensor:
    """Reference of :func:`fp8_swiglu_experts`: the unfused composition of the modules."""
    _check(x_RD, tokens_per_expert_E, gate_proj, up_proj, down_proj)
    return _composed_mlp(x_RD, tokens_per_expert_E, (gate_proj, up_proj, down_proj))


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
    if _fusable(projections):
        return fp8_swiglu_experts(x_RD, tokens_per_expert_E, *projections)
    return _composed_mlp(x_RD, tokens_per_expert_E, projections)
