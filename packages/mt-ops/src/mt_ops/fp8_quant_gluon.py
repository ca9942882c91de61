"""The dual 1×128 quantizer (:func:`mt_ops.fp8_quant.quantize_1x128_dual`) as a Gluon kernel.

Legend as in :mod:`mt_ops.fp8_quant`: M rows, K columns, T row tiles.

Same arguments, layouts and bits as the Triton kernel there (checked against the reference
on the H200 by ``test_fp8_quant``'s GPU tests); what differs is who places the data. Triton
gives the [128, 128] tile a layout made for the row-major load and then moves the fp8
result through shared memory one byte per instruction to store the transposed half (Nsight
Compute on the H200: 156 byte stores to shared memory per warp and tile). Here each thread
holds 8 consecutive rows × 16 columns (``LAYOUT``), so:

- a thread's loads are 32-byte runs of a row (16 bf16 columns), its row-major stores
  16-byte runs;
- a thread packs each column's 4 consecutive rows into one 32-bit word in registers (two
  ``cvt.rn.satfinite.e4m3x2.f32``, the conversion Triton's fp8 cast uses), and the words
  reach the layout of the transposed store (``WORD_LAYOUT``: a thread's 8 rows of a column
  as one 8-byte store) through shared memory in 16-byte vectors, 8 stores and 8 loads per
  thread and tile in place of Triton's 128 byte stores. ``WORD_LAYOUT`` holds other
  columns per thread than ``LAYOUT``; a linear layout with ``LAYOUT``'s lanes and warps
  would skip shared memory, but compiles to 64-112 bytes of spills at 168 registers (a
  review's finding, not measured on the GPU).

H200 (``bench_ops_fp8.py --sections quant``), [65536, 4096] bf16: 288 us = 0.90x of copy
bandwidth, against 321 us = 0.80x for the Triton kernel in the same run. Experiments at
[98304, 2048]: 237 against 247 us in the earlier layout of the transposed data
([K, 128·T], 0.81x against 0.78x); tile-major, 228 us (0.84x). Storing the row scales
M-major as well, so that every write of a program is contiguous, ran 202 us (0.955x;
[65536, 4096] 0.965x), but the Hopper fprop/dgrad GEMMs then read A's scales 25-33% slower
(same kernel code; DeepSeek-V2-Lite's FP8 MLP step 7.04 -> 7.67 ms), and loading them by
TMA with the operand tiles stopped the H200 with an illegal instruction (not investigated
for lack of device time), so the row scales stay row-major. Measured and not kept
(0.59-0.80x): 4 or 16 rows × 8-32 columns per thread, 8 or 16 warps, warps along rows
only, and a persistent kernel reading tiles through a 2-3 stage TMA ring (0.80x at one
program per SM); grouping row tiles in the grid, 0.79-0.81x.

With expert tiles (``tiles``) the gain was lost: in DeepSeek-V2-Lite's FP8 MLP step (16k
tokens, 64 experts) x's quantization took 252 us, the Triton kernel's 251. The compiled
code differs by the two loads of the tile's bounds, but ptxas gave that variant 174
registers per thread, 2 programs per SM instead of 3; ``MAX_REGISTERS`` now caps every
variant at 168 (no spills). Its effect on the time is not measured yet.
"""

from functools import cache

import torch
from torch import Tensor

# Shared with the Triton kernels (a Gluon kernel may call a @triton.jit function): the
# power-of-two exponent of mt_ops.fp8_quant's docstring and the fp32 / E8M0 scale store.
from mt_ops.fp8_quant import _pow2_exponent_tl, _store_scale

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton: the Triton kernel runs instead
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "launch_dual", "supported"]

_NUM_WARPS = 4
# Registers per thread: 3 programs of 128 threads fill the H200's 65536 at 168 or fewer
# (ptxas allocates in steps of 8). Left alone, ptxas gives the variants 168-184 (174 with
# expert tiles, 180-184 with E8M0 scales), which leaves 2 programs per SM; capped, every
# variant compiles to 168 without spills (test_fp8_gemm_hopper checks both).
MAX_REGISTERS = 168
if HAS_GLUON:
    # [32 row quads, 4 rows, 128 columns]: 2 quads × 4 rows × 16 columns per thread, lanes
    # 8 along quads × 4 along columns, warps 2 × 2.
    LAYOUT = gl.constexpr(gl.BlockedLayout([2, 4, 16], [8, 1, 4], [2, 1, 2], [2, 1, 0]))
    # The packed transposed words [128 columns, 32 quads], registers walking the quads, so a
    # thread's 2 words of a column are one 8-byte store (reached from LAYOUT through shared
    # memory: see the module docstring).
    WORD_LAYOUT = gl.constexpr(gl.BlockedLayout([16, 2], [4, 8], [2, 2], [1, 0]))


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def supported(x: Tensor) -> bool:
    """Whether the Gluon kernel runs ``x``: Gluon imports and x is on a Hopper GPU (the
    kernel was measured and checked there; the Triton kernel serves other devices)."""
    return HAS_GLUON and x.is_cuda and _capability(x.device) == (9, 0)


if HAS_GLUON:

    @gluon.jit
    def _pack4(a, b, c, d):
        """Four fp32 values (already scaled) as e4m3 bytes of one int32, ``a`` lowest."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [a, b, c, d], dtype=gl.int32, is_pure=True, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _dual_kernel(
        x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, tile_start_ptr, tile_end_ptr, src_row_ptr,
        row_weight_ptr, num_rows, num_cols, stride_x, num_col_tiles,
        SEGMENTED: gl.constexpr, E8M0: gl.constexpr, GATHER: gl.constexpr,
        WEIGHTED: gl.constexpr,
    ):  # fmt: skip
        rows_l: gl.constexpr = gl.SliceLayout(2, LAYOUT)  # [32, 4]
        cols_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT))  # [128]
        pid = gl.program_id(0)
        pid_k = pid % num_col_tiles  # column tiles fastest: programs running together
        pid_m = pid // num_col_tiles  # share rows
        if SEGMENTED:
            row_start = gl.load(tile_start_ptr + pid_m)
            row_end = gl.load(tile_end_ptr + pid_m)
        else:
            row_start = pid_m * 128
            row_end = gl.minimum(row_start + 128, num_rows)
        quad = gl.arange(0, 32, layout=gl.SliceLayout(1, rows_l))
        in_quad = gl.arange(0, 4, layout=gl.SliceLayout(0, rows_l))
        rows = row_start + quad[:, None] * 4 + in_quad[None, :]  # [32, 4]
        row_ok = rows < row_end
        rows64 = rows.to(gl.int64)
        cols = pid_k * 128 + gl.arange(0, 128, layout=cols_l)
        col_ok = cols < num_cols
        mask = row_ok[:, :, None] & col_ok[None, None, :]
        src64 = rows64
        if GATHER:  # row r of the result is row src[r] of x (a fused MoE permute)
            src64 = gl.load(src_row_ptr + rows64, mask=row_ok, other=0).to(gl.int64)
        x = gl.load(x_ptr + src64[:, :, None] * stride_x + cols[None, None, :], mask=mask,
                    other=0.0)  # fmt: skip
        if WEIGHTED:  # scaled and rounded to x's dtype first, as a weighted copy would be
            w = gl.load(row_weight_ptr + rows64, mask=row_ok, other=0.0).to(gl.float32)
            x = (w[:, :, None] * x.to(gl.float32)).to(x_ptr.dtype.element_ty)
        x = x.to(gl.float32)
        # Rows: 1×128 scales.
        k = _pow2_exponent_tl(gl.max(gl.abs(x), axis=2))  # [32, 4]
        q = x * ((127 - k) << 23).to(gl.float32, bitcast=True)[:, :, None]
        gl.store(q_ptr + rows64[:, :, None] * num_cols + cols[None, None, :],
                 q.to(q_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        _store_scale(s_ptr, rows64 * num_col_tiles + pid_k, k, row_ok, E8M0)
        # Columns: 128×1 scales of the tile; rows past its end hold 0 and are written as the
        # padding of qt[pid_m] (tile-major [T, K, 128], viewed as int32 [T, K, 32]).
        kc = _pow2_exponent_tl(gl.max(gl.max(gl.abs(x), axis=1), axis=0))  # [128]
        y = x * ((127 - kc) << 23).to(gl.float32, bitcast=True)[None, None, :]
        y = gl.reshape(gl.permute(y, (0, 2, 1)), (32, 128, 2, 2))  # row 4i + 2a + b
        even, odd = gl.split(y)  # b = 0 and b = 1
        y0, y2 = gl.split(even)
        y1, y3 = gl.split(odd)
        words = gl.convert_layout(gl.permute(_pack4(y0, y1, y2, y3), (1, 0)), WORD_LAYOUT)
        word_cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, WORD_LAYOUT))
        word_quads = gl.arange(0, 32, layout=gl.SliceLayout(0, WORD_LAYOUT))
        word_offs = (pid_m.to(gl.int64) * num_cols + word_cols)[:, None] * 32 + word_quads[None, :]
        gl.store(qt_ptr + word_offs, words, mask=(word_cols < num_cols)[:, None])
        _store_scale(st_ptr, pid_m.to(gl.int64) * num_cols + cols, kc, col_ok, E8M0)


def _launch(kernel, grid, *args, **kwargs):
    """Launches a Gluon kernel (a seam: the CPU test compiles through it instead)."""
    return kernel[grid](*args, **kwargs)


def launch_dual(x_MK, q, s, qt, st, tile_start, tile_end, source_rows, row_weights,
                num_rows, num_row_tiles, segmented, e8m0, gather, weighted) -> None:  # fmt: skip
    """Fills the outputs of ``quantize_1x128_dual`` (allocated by mt_ops.fp8_quant; scale
    tensors as their storage: fp32, or uint8 for E8M0). The caller checks :func:`supported`."""
    num_cols = x_MK.shape[1]
    num_col_tiles = -(-num_cols // 128)
    _launch(
        _dual_kernel, (num_row_tiles * num_col_tiles,),
        x_MK, q, s, qt.view(torch.int32), st, tile_start, tile_end, source_rows, row_weights,
        num_rows, num_cols, x_MK.stride(0), num_col_tiles,
        SEGMENTED=segmented, E8M0=e8m0, GATHER=gather, WEIGHTED=weighted,
        num_warps=_NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
