"""SwiGLU fused with FP8 1×128 quantization: of its output (forward), of its gradients (backward).

Legend: R routed rows (tokens), F expert hidden dim, T row tiles.

In an FP8 expert MLP the SwiGLU output ``h = silu(gate) * up`` is only read by the down
projection, which needs it quantized twice: by 1×128 rows (fprop) and by 128-token tiles
of ``hᵀ`` (wgrad). Unfused, that is a SwiGLU pass (read gate and up, write h) and a
quantization pass (read h, write both): 10 bytes per element in bf16. The fused forward
reads gate and up and writes the two fp8 copies: 6 bytes. The backward is the same story
for ``dgate`` and ``dup``, which only feed the FP8 dgrad and wgrad of the gate and up
projections: the fused kernel reads ``dh``, gate and up once and writes the four fp8
tensors (10 bytes instead of 3 + 2 + 4 + 4 + 4 = 22 bytes read and written by the
SwiGLU backward plus two quantization passes). On the H200 that kernel is held back by
register pressure and the two-pass path is faster, so ``SWIGLU_QUANT_CONFIG`` picks it.

Semantics: exactly those of the unfused ops. The SwiGLU value (or gradient) is computed in
fp32 as :mod:`mt_ops.swiglu` does, rounded to the input dtype (the tensor the unfused path
would have written), then quantized as :func:`mt_ops.fp8_quant.quantize_1x128_dual`.
On GPU the fused kernels equal ``quantize_1x128_dual(swiglu(gate, up))`` bit for bit
(tests check it); the references spell the formulas out in PyTorch.
"""

import torch
from torch import Tensor

from mt_ops._triton import cdiv, launch, sigmoid, tl, triton, use_kernels
from mt_ops.fp8_quant import (
    BLOCK,
    QUANT_CONFIG,
    Fp8Quantized,
    RowTiles,
    ScaleFormat,
    _check_scale_format,
    _launch_1x128,
    _quantize_store_dual,
    _row_scales,
    _scale_storage,
    _tile_pointers,
    _transposed_outputs,
    quantize_1x128_dual_reference,
)
from mt_ops.swiglu import _swiglu_bwd

__all__ = [
    "swiglu_backward_quantize_1x128",
    "swiglu_backward_quantize_1x128_reference",
    "swiglu_quantize_1x128",
    "swiglu_quantize_1x128_reference",
]

DualQuantized = tuple[Fp8Quantized, Fp8Quantized]

# One program per 128-row tile × 128 columns (the quantization tile), column tiles fastest.
# H200 sweep ([131072, 768] bf16, Qwen3 tiles): forward 251-259 us at 8 warps (316 at 4;
# unfused SwiGLU + quantization 286-321). Backward 699-708 us at 16 warps, 711 at 8, 2424 at
# 4 (spills: both gradients are quantized from registers). That is no faster than the
# unfused SwiGLU backward (235 us in the MLP profile) plus two dual quantizations; the
# bench's unfused timing of 664-735 us included a SwiGLU forward, so the two were not yet
# compared cleanly. Splitting dgate and dup over two programs (each quantizing one
# gradient) was slower: 774-782 us at 8-16 warps, 2555 at 4 (Qwen3 tiles; DeepSeek-V2-Lite
# [98304, 1408]: 914 us fused at 16 warps, 1029-1035 split).
# bwd_fused False runs the SwiGLU backward kernel and two dual quantizations instead of the
# one-pass kernel (same bytes out, bit for bit); bench_ops_fp8.py times both. In the whole
# FP8 expert MLP step (H200, 16k tokens) the unfused backward is the faster one: Qwen3
# 7.25 against 7.39 ms balanced, 7.54 against 7.66 skewed; DeepSeek-V2-Lite 8.70 against
# 8.92 and 9.09 against 9.21. Alone: 521 against 702 us ([131072, 768], Qwen3 tiles) and
# 693 against 927 ([98304, 1408]). So it is the default; the fused kernel stays, tested,
# for the day its register pressure is solved.
# Measured and not kept (H200, 2026-12-01, DeepSeek-V2-Lite [98304, 1408], balanced tiles):
# the fused backward reading grad and gate again for dup (so that nothing but the gradient
# being quantized stays live) ran 935 / 919 us at 8 / 16 warps, against 853 / 849 holding
# them and 639 unfused (Qwen3 [131072, 768]: 696 against 640 and 476). Gluon kernels with
# the dual quantizer's layout (branch gluon-swiglu, bit-exact): forward 351 us at 4 warps,
# 357 at 8 with 128 registers, 534 at 8 without a cap, against 328 for this kernel in the
# MLP step; the backward fused in Gluon made the step slower (7.09 against 6.99 ms).
# The forward at 16 warps (H200, alone, balanced expert tiles, bit-exact): 350 us against
# 306 at 8 and 383 at 4 ([98304, 1408]); 267 against 233 and 293 ([131072, 768]); the MLP
# step 6.73 against 6.70 ms and 5.38 against 5.35 (five alternating rounds).
# A persistent forward (one or two programs per SM walking the tiles, its loads software-
# pipelined by tl.range's num_stages into cp.async; bit-exact) ran 458-1030 us against 282
# for this kernel ([98304, 1408]; 346-790 against 215 for [131072, 768]): the loop raised
# the registers to 168 at 8 warps, leaving too few warps per SM to hide the loads.
SWIGLU_QUANT_CONFIG = {"fwd_warps": 8, "bwd_warps": 16, "bwd_fused": False}


@triton.jit
def _swiglu_quant_fwd_kernel(
    gate_ptr, up_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, tile_start_ptr, tile_end_ptr,
    num_rows, num_cols, num_col_tiles,
    SEGMENTED: tl.constexpr, E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TRANS_STORE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, rows64, row_ok, cols, col_ok = _tile_pointers(
        tile_start_ptr, tile_end_ptr, num_rows, num_cols, num_col_tiles,
        SEGMENTED, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    offs = rows64[:, None] * num_cols + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * sigmoid(g) * u  # as mt_ops.swiglu's kernel, then rounded to the input dtype
    h = h.to(gate_ptr.dtype.element_ty).to(tl.float32)
    _quantize_store_dual(
        h, rows64, row_ok, cols, col_ok, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr,
        num_cols, num_col_tiles, True, True, E8M0, BLOCK_M, BLOCK_K, TRANS_STORE,
    )  # fmt: skip


@triton.jit
def _swiglu_quant_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr,
    qg_ptr, sg_ptr, qgt_ptr, sgt_ptr, qu_ptr, su_ptr, qut_ptr, sut_ptr,
    tile_start_ptr, tile_end_ptr, num_rows, num_cols, num_col_tiles,
    SEGMENTED: tl.constexpr, E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TRANS_STORE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, rows64, row_ok, cols, col_ok = _tile_pointers(
        tile_start_ptr, tile_end_ptr, num_rows, num_cols, num_col_tiles,
        SEGMENTED, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    offs = rows64[:, None] * num_cols + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    dout = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = sigmoid(g)
    # The same expressions as mt_ops.swiglu's backward kernel, rounded to the input dtype.
    dgate = dout * u * sig * (1.0 + g * (1.0 - sig))
    dgate = dgate.to(gate_ptr.dtype.element_ty).to(tl.float32)
    _quantize_store_dual(
        dgate, rows64, row_ok, cols, col_ok, pid_m, pid_k, qg_ptr, sg_ptr, qgt_ptr, sgt_ptr,
        num_cols, num_col_tiles, True, True, E8M0, BLOCK_M, BLOCK_K, TRANS_STORE,
    )  # fmt: skip
    silu = g * sig
    dup = (dout * silu).to(gate_ptr.dtype.element_ty).to(tl.float32)
    _quantize_store_dual(
        dup, rows64, row_ok, cols, col_ok, pid_m, pid_k, qu_ptr, su_ptr, qut_ptr, sut_ptr,
        num_cols, num_col_tiles, True, True, E8M0, BLOCK_M, BLOCK_K, TRANS_STORE,
    )  # fmt: skip


def _check(tensors: dict[str, Tensor], tiles: RowTiles | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(tensors.values()))
    if first.dim() != 2 or len(set(shapes.values())) != 1:
        raise ValueError(f"shapes {shapes} must all be the same 2-D [R, F]; flatten leading dims")
    if len({t.dtype for t in tensors.values()}) != 1:
        dtypes = {name: t.dtype for name, t in tensors.items()}
        raise ValueError(f"dtypes {dtypes} must agree; cast the gradient to the gate's dtype")
    if tiles is not None and tiles.num_rows != first.shape[0]:
        raise ValueError(
            f"tiles cover {tiles.num_rows} rows but the inputs have {first.shape[0]}; "
            "build them with row_tiles(tokens_per_expert, num_rows=R)"
        )


def _outputs(num_rows, num_cols, num_row_tiles, scale_format, device) -> DualQuantized:
    rows = Fp8Quantized(
        torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=device),
        _row_scales(num_rows, num_cols, scale_format, device),
    )
    return rows, Fp8Quantized(*_transposed_outputs(num_row_tiles, num_cols, scale_format, device))


def _flat(dual: DualQuantized) -> list[Tensor]:
    rows, cols = dual
    return [rows.data, _scale_storage(rows.scale), cols.data, _scale_storage(cols.scale)]


def _launch(kernel, inputs, num_outputs, tiles, scale_format, num_warps):
    num_rows, num_cols = inputs[0].shape
    device = inputs[0].device
    segmented = tiles is not None
    num_row_tiles = tiles.num_tiles if segmented else cdiv(num_rows, BLOCK)
    num_col_tiles = cdiv(num_cols, BLOCK)
    outs = [_outputs(num_rows, num_cols, num_row_tiles, scale_format, device)
            for _ in range(num_outputs)]  # fmt: skip
    dummy = torch.empty(1, dtype=torch.int32, device=device)  # never read
    launch(
        kernel, (num_row_tiles * num_col_tiles,),
        *inputs, *[t for out in outs for t in _flat(out)],
        tiles.start_T if segmented else dummy, tiles.end_T if segmented else dummy,
        num_rows, num_cols, num_col_tiles,
        SEGMENTED=segmented, E8M0=scale_format == "e8m0", BLOCK_M=BLOCK, BLOCK_K=BLOCK,
        TRANS_STORE=QUANT_CONFIG["dual_trans_store"], num_warps=num_warps,
    )  # fmt: skip
    return outs


def swiglu_quantize_1x128(
    gate_RF: Tensor,
    up_RF: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
) -> DualQuantized:
    """``quantize_1x128_dual(swiglu(gate, up))`` in one pass, without writing the SwiGLU output.

    Args:
        gate_RF: Gate projection [R, F] (bf16 or fp32, contiguous).
        up_RF: Up projection, same shape and dtype.
        tiles: Row tiles that restart at each expert; None: plain 128-row tiles.
        scale_format: ``"fp32"`` or ``"e8m0"``.

    Returns:
        ``(rowwise, transposed)`` as :func:`mt_ops.fp8_quant.quantize_1x128_dual` returns.
    """
    _check_scale_format(scale_format)
    _check({"gate": gate_RF, "up": up_RF}, tiles)
    if not use_kernels(gate_RF, up_RF):
        return swiglu_quantize_1x128_reference(
            gate_RF, up_RF, tiles=tiles, scale_format=scale_format
        )
    return _launch_fwd(gate_RF.contiguous(), up_RF.contiguous(), tiles, scale_format)


def _launch_fwd(gate_RF, up_RF, tiles, scale_format) -> DualQuantized:
    (out,) = _launch(_swiglu_quant_fwd_kernel, [gate_RF, up_RF], 1, tiles, scale_format,
                     SWIGLU_QUANT_CONFIG["fwd_warps"])  # fmt: skip
    return out


def swiglu_backward_quantize_1x128(
    grad_RF: Tensor,
    gate_RF: Tensor,
    up_RF: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
) -> tuple[DualQuantized, DualQuantized]:
    """SwiGLU's input gradients, each quantized as ``quantize_1x128_dual``, in one pass.

    Args:
        grad_RF: Gradient of the SwiGLU output [R, F].
        gate_RF: The forward's gate input [R, F], same dtype.
        up_RF: The forward's up input [R, F], same dtype.
        tiles: Row tiles that restart at each expert; None: plain 128-row tiles.
        scale_format: ``"fp32"`` or ``"e8m0"``.

    Returns:
        ``(dgate, dup)``, each a ``(rowwise, transposed)`` pair.
    """
    _check_scale_format(scale_format)
    _check({"grad": grad_RF, "gate": gate_RF, "up": up_RF}, tiles)
    if not use_kernels(grad_RF, gate_RF, up_RF):
        return swiglu_backward_quantize_1x128_reference(
            grad_RF, gate_RF, up_RF, tiles=tiles, scale_format=scale_format
        )
    return _launch_bwd(
        grad_RF.contiguous(), gate_RF.contiguous(), up_RF.contiguous(), tiles, scale_format
    )


def _launch_bwd(grad_RF, gate_RF, up_RF, tiles, scale_format):
    if not SWIGLU_QUANT_CONFIG["bwd_fused"]:
        dgate_RF, dup_RF = _swiglu_bwd(grad_RF, gate_RF, up_RF)
        return (
            _launch_1x128(dgate_RF, tiles, True, True, scale_format),
            _launch_1x128(dup_RF, tiles, True, True, scale_format),
        )
    dgate, dup = _launch(_swiglu_quant_bwd_kernel, [grad_RF, gate_RF, up_RF], 2, tiles,
                         scale_format, SWIGLU_QUANT_CONFIG["bwd_warps"])  # fmt: skip
    return dgate, dup


def _kernels_for_test():
    """The two launchers, runnable on CPU tensors through Triton's interpreter."""
    return _launch_fwd, _launch_bwd


def swiglu_quantize_1x128_reference(
    gate_RF: Tensor,
    up_RF: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
) -> DualQuantized:
    """Reference of :func:`swiglu_quantize_1x128` in plain PyTorch (same arguments, results)."""
    _check_scale_format(scale_format)
    _check({"gate": gate_RF, "up": up_RF}, tiles)
    g = gate_RF.float()
    h_RF = (g * torch.sigmoid(g) * up_RF.float()).to(gate_RF.dtype)
    return quantize_1x128_dual_reference(h_RF, tiles=tiles, scale_format=scale_format)


def swiglu_backward_quantize_1x128_reference(
    grad_RF: Tensor,
    gate_RF: Tensor,
    up_RF: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
) -> tuple[DualQuantized, DualQuantized]:
    """Reference of :func:`swiglu_backward_quantize_1x128` in plain PyTorch."""
    _check_scale_format(scale_format)
    _check({"grad": grad_RF, "gate": gate_RF, "up": up_RF}, tiles)
    dout, g, u = grad_RF.float(), gate_RF.float(), up_RF.float()
    sig = torch.sigmoid(g)
    dgate_RF = (dout * u * sig * (1.0 + g * (1.0 - sig))).to(gate_RF.dtype)
    dup_RF = (dout * (g * sig)).to(gate_RF.dtype)
    return (
        quantize_1x128_dual_reference(dgate_RF, tiles=tiles, scale_format=scale_format),
        quantize_1x128_dual_reference(dup_RF, tiles=tiles, scale_format=scale_format),
    )
