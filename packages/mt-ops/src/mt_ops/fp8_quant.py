"""FP8 (E4M3) block quantization: 1×128 tiles for activations/gradients, 128×128 for weights.

Legend: M rows (tokens), K columns (the contraction dim of the GEMM that reads the result),
N weight rows, E groups (experts), T row tiles.

DeepSeek-V3's recipe scales every 1×128 tile of an activation (one row, 128 columns) and
every 128×128 block of a weight by its own factor, so one outlier only costs precision in
its own tile. Our scales are powers of two, rounded up: ``scale = 2**k`` with the smallest
``k`` such that ``amax / scale <= 448`` (the E4M3 maximum). Multiplying by a power of two is
exact, so dequantization is exact and the scale fits Blackwell's E8M0 format (an 8-bit
exponent, stored here as ``torch.float8_e8m0fnu``) as well as fp32 on Hopper. ``k`` is read
straight off the fp32 bits of ``amax`` (448 = 1.75·2**8): ``k = exponent(amax) - 8``, plus
one when the mantissa of ``amax`` exceeds 1.75; no division, so kernel and reference agree
bit for bit. An all-zero tile gets scale 1. The references clamp to ±448 before the cast,
because PyTorch 2.11's cast to ``float8_e4m3fn`` turns overflow into NaN. The kernels need
no clamp: a finite scaled value never exceeds 448, and their conversion saturates ±inf to
±448 as the clamp does (removing the clamps cut the dual kernel from 20 to 16 instructions
per element; its time on the H200 did not change). NaN is the one input where kernels and
references differ: both write a NaN element as NaN (the kernels' old clamp wrote -448), but
the kernels' amax skips NaN, so the rest of the tile keeps its scale, while the
references' amax is NaN, which gives the tile scale 2**120 and zeros elsewhere.

Eager PyTorch needs an abs, an amax, a division and a cast, each a pass over memory; the
kernels read each element once and write fp8 data and scales in the same pass. The dual
(fused-transposed) kernel quantizes ``x`` by rows (for fprop/dgrad) *and* ``xᵀ`` by
128-row tiles (for wgrad, where the tokens are the contraction dim) from one read.
With ``tiles`` (see :func:`row_tiles`), the transposed tiles restart at each expert's first
row, so an expert's wgrad never shares a scale with another expert's tokens.

The transposed data is *tile-major* and *tile-padded*, ``[T, K, 128]``: ``data[i, c]`` holds
column ``c`` of tile ``i``'s rows, then zeros up to 128, so each tile's block is one
contiguous ``[K, 128]`` matrix whose rows start 16-byte aligned (the wgrad GEMM loads full
16-byte vectors, and a program of the dual kernel writes its transposed tile as one
contiguous block); its scales are ``[T, K]``. :mod:`mt_ops.fp8_quant_gluon` has what the
layouts measured.
"""

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from mt_ops._counts import check_counts
from mt_ops._triton import cdiv, launch, tl, triton, use_kernels

__all__ = [
    "FP8_MAX",
    "Fp8Quantized",
    "RowTiles",
    "ScaleFormat",
    "dequantize_1x128",
    "dequantize_128x128",
    "dequantize_tiles_transposed",
    "quantize_128x128",
    "quantize_128x128_reference",
    "quantize_1x128",
    "quantize_1x128_dual",
    "quantize_1x128_dual_reference",
    "quantize_1x128_reference",
    "row_tiles",
    "row_tiles_reference",
    "scale_to_float",
]

FP8_MAX = 448.0
BLOCK = 128
ScaleFormat = Literal["fp32", "e8m0"]
_FP8 = torch.float8_e4m3fn


class Fp8Quantized(NamedTuple):
    """FP8 data and the scales that dequantize it (``x ≈ data.float() * scale``).

    Attributes:
        data: float8_e4m3fn tensor.
        scale: Power-of-two scales, float32 or float8_e8m0fnu, one per tile/block.
    """

    data: Tensor
    scale: Tensor


@dataclass(frozen=True)
class RowTiles:
    """Tiles of at most 128 consecutive rows that never cross a group (expert) boundary.

    Tile ``i`` covers rows ``[start_T[i], end_T[i])`` of group ``group_T[i]``. There are
    ``T = ceil(M / 128) + G`` tile slots (a bound that needs no host sync); unused slots
    have ``start == end == 0`` and ``group == G``. Tiles of one group are consecutive and in
    row order.

    Attributes:
        start_T: First row of each tile, int32 [T].
        end_T: One past the last row, int32 [T].
        group_T: Group of each tile, int32 [T] (G for unused slots).
        group_first_tile_G: Index of each group's first tile, int32 [G + 1] (last = used).
        num_rows: M.
    """

    start_T: Tensor
    end_T: Tensor
    group_T: Tensor
    group_first_tile_G: Tensor
    num_rows: int

    @property
    def num_tiles(self) -> int:
        """T, the number of tile slots (used and unused)."""
        return self.start_T.numel()


# Each program sums the counts (G is small) and writes BLOCK_T tile slots: group g of slot
# t is the number of groups whose tiles end at or before t, and the group's first row and
# tile are the largest row and tile ends among those groups. One kernel in place of the ~20
# small eager ones of row_tiles_reference (H200, DeepSeek-V2-Lite's fp8 expert MLP step at
# 16k tokens: 15 kernels a step instead of 50, 0.06-0.14 ms of ~7.2 saved).
_ROW_TILES_MAX_GROUPS = 1024  # [slots, groups] comparisons per block; more groups: eager


@triton.jit
def _row_tiles_kernel(
    counts_ptr, start_ptr, end_ptr, group_ptr, first_ptr, num_groups, num_slots,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    g = tl.arange(0, BLOCK_G)
    g_ok = g < num_groups
    counts = tl.load(counts_ptr + g, mask=g_ok, other=0).to(tl.int32)
    row_ends = tl.cumsum(counts, axis=0)
    tile_ends = tl.cumsum((counts + TILE - 1) // TILE, axis=0)
    if tl.program_id(0) == 0:
        tl.store(first_ptr + g, tl.zeros_like(g), mask=g == 0)
        tl.store(first_ptr + 1 + g, tile_ends, mask=g_ok)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    before = (tile_ends[None, :] <= t[:, None]) & g_ok[None, :]  # the groups before t's
    group = tl.sum(before.to(tl.int32), axis=1)  # G for unused slots
    first_tile = tl.max(tl.where(before, tile_ends[None, :], 0), axis=1)
    first_row = tl.max(tl.where(before, row_ends[None, :], 0), axis=1)
    end_row = tl.min(tl.where(before | ~g_ok[None, :], 2**31 - 1, row_ends[None, :]), axis=1)
    start = first_row + TILE * (t - first_tile)
    used = group < num_groups
    ok = t < num_slots
    tl.store(start_ptr + t, tl.where(used, start, 0), mask=ok)
    tl.store(end_ptr + t, tl.where(used, tl.minimum(start + TILE, end_row), 0), mask=ok)
    tl.store(group_ptr + t, group, mask=ok)


def row_tiles(rows_per_group_G: Tensor, num_rows: int) -> RowTiles:
    """Splits each group's rows into 128-row tiles, on the groups' device, without host sync.

    Args:
        rows_per_group_G: Rows of each group, integer [G], summing to ``num_rows``;
            groups' rows are consecutive, in group order.
        num_rows: M, the total number of rows.

    Returns:
        The :class:`RowTiles`; on CUDA one kernel writes them (:func:`row_tiles_reference`
        in eager PyTorch otherwise, with the same result).
    """
    num_groups = rows_per_group_G.numel()
    if not use_kernels(rows_per_group_G) or not 0 < num_groups <= _ROW_TILES_MAX_GROUPS:
        return row_tiles_reference(rows_per_group_G, num_rows)
    return _launch_row_tiles(rows_per_group_G, num_rows)


def _launch_row_tiles(rows_per_group_G: Tensor, num_rows: int) -> RowTiles:
    num_groups = rows_per_group_G.numel()
    num_slots = cdiv(num_rows, BLOCK) + num_groups
    device = rows_per_group_G.device
    start_T, end_T, group_T = torch.empty(3, num_slots, dtype=torch.int32, device=device)
    first_G = torch.empty(num_groups + 1, dtype=torch.int32, device=device)
    block_g = triton.next_power_of_2(num_groups)
    block_t = max(16, min(64, 8192 // block_g))
    launch(
        _row_tiles_kernel, (cdiv(num_slots, block_t),), rows_per_group_G.contiguous(), start_T,
        end_T, group_T, first_G, num_groups, num_slots, BLOCK_G=block_g, BLOCK_T=block_t,
        TILE=BLOCK,
    )  # fmt: skip
    return RowTiles(start_T, end_T, group_T, first_G, num_rows)


def row_tiles_reference(rows_per_group_G: Tensor, num_rows: int) -> RowTiles:
    """:func:`row_tiles` in eager PyTorch (same arguments and result); host counts (CPU)
    are checked, naming the first negative count or the wrong sum."""
    if rows_per_group_G.device.type == "cpu":  # free to check on the host; no sync on GPU
        check_counts(rows_per_group_G.tolist(), num_rows, "rows_per_group", "rows (num_rows)")
    counts_G = rows_per_group_G.long()
    num_groups = counts_G.numel()
    device = counts_G.device
    ends_G = torch.cumsum(counts_G, 0)  # [G]
    tiles_G = (counts_G + BLOCK - 1) // BLOCK  # [G]
    tile_ends_G = torch.cumsum(tiles_G, 0)  # [G]
    num_slots = cdiv(num_rows, BLOCK) + num_groups
    slot_T = torch.arange(num_slots, device=device)
    group_T = torch.searchsorted(tile_ends_G, slot_T, right=True)  # [T], G when unused
    g_T = group_T.clamp(max=max(num_groups - 1, 0))
    if num_groups == 0:
        zeros = torch.zeros(num_slots, dtype=torch.int32, device=device)
        first = torch.zeros(1, dtype=torch.int32, device=device)
        return RowTiles(zeros, zeros, zeros, first, num_rows)
    tile_in_group_T = slot_T - (tile_ends_G - tiles_G)[g_T]
    start_T = (ends_G - counts_G)[g_T] + BLOCK * tile_in_group_T
    end_T = torch.minimum(start_T + BLOCK, ends_G[g_T])
    used_T = group_T < num_groups
    start_T = torch.where(used_T, start_T, 0)
    end_T = torch.where(used_T, end_T, 0)
    first_G = torch.cat([tile_ends_G.new_zeros(1), tile_ends_G])  # [G + 1]
    return RowTiles(start_T.int(), end_T.int(), group_T.int(), first_G.int(), num_rows)


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in ("fp32", "e8m0"):
        raise ValueError(
            f"scale_format ({scale_format!r}) must be 'fp32' (Hopper) or 'e8m0' (Blackwell)"
        )


def _empty_scales(shape, scale_format: ScaleFormat, device) -> Tensor:
    if scale_format == "e8m0":
        return torch.empty(shape, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _row_scales(num_rows: int, num_cols: int, scale_format: ScaleFormat, device) -> Tensor:
    """Scales of a 1×128 row quantization: [M, ceil(K/128)]."""
    return _empty_scales((num_rows, cdiv(num_cols, BLOCK)), scale_format, device)


def _transposed_outputs(num_row_tiles: int, num_cols: int, scale_format: ScaleFormat, device):
    """Data [T, K, 128] and scales [T, K] of a transposed (128-row tile) quantization."""
    data = torch.empty((num_row_tiles, num_cols, BLOCK), dtype=_FP8, device=device)
    return data, _empty_scales((num_row_tiles, num_cols), scale_format, device)


def _scale_storage(scale: Tensor) -> Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def scale_to_float(scale: Tensor) -> Tensor:
    """Scales as float32 (E8M0 bytes ``b`` mean ``2**(b - 127)``)."""
    if scale.dtype == torch.float8_e8m0fnu:
        bits = scale.view(torch.uint8).to(torch.int32) << 23  # exponent field
        return bits.view(torch.float32)
    return scale.float()


# Shared pieces of the 1×128 kernels (also used by the fused SwiGLU quantizers,
# mt_ops.fp8_swiglu). ``_pow2_exponent_tl`` is the k of the module docstring, from the bits.
@triton.jit
def _pow2_exponent_tl(amax):
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.where(amax == 0.0, 0, tl.maximum(k, -126))


@triton.jit
def _store_scale(ptr, offs, k, mask, E8M0: tl.constexpr):
    if E8M0:
        tl.store(ptr + offs, (k + 127).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr + offs, ((k + 127) << 23).to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _tile_rows(tile_start_ptr, tile_end_ptr, pid_m, num_rows,
               SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """First row and end row of row tile ``pid_m`` (an expert tile when SEGMENTED)."""
    if SEGMENTED:
        row_start = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
    else:
        row_start = pid_m * BLOCK_M
        row_end = tl.minimum(row_start + BLOCK_M, num_rows)
    return row_start, row_end


@triton.jit
def _quantize_store_dual(
    x, rows64, row_ok, cols, col_ok, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr,
    num_cols, num_col_tiles,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TRANS_STORE: tl.constexpr,
):  # fmt: skip
    """Quantizes an fp32 [BLOCK_M, 128] tile (rows past the tile end hold 0) and stores it.

    ROWWISE: 1×128 scales into q [M, K] / s [M, K/128]. COLWISE: 128×1 scales of the
    transposed tile into the tile-major qt [T, K, 128] / st [T, K] (module docstring).
    """
    mask = row_ok[:, None] & col_ok[None, :]
    if ROWWISE:
        k = _pow2_exponent_tl(tl.max(tl.abs(x), axis=1))  # [BLOCK_M]
        inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
        q = x * inv[:, None]
        q_offs = rows64[:, None] * num_cols + cols[None, :]
        tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        _store_scale(s_ptr, rows64 * num_col_tiles + pid_k, k, row_ok, E8M0)
    if COLWISE:
        kc = _pow2_exponent_tl(tl.max(tl.abs(x), axis=0))  # [BLOCK_K]
        inv_c = ((127 - kc) << 23).to(tl.float32, bitcast=True)
        qc = x * inv_c[None, :]
        # This tile owns qt[pid_m]: row c holds column c of the tile; rows past the tile
        # end were loaded as 0 and are written as zero padding.
        tile_rows = tl.arange(0, BLOCK_M)
        qt_cols = (pid_m.to(tl.int64) * num_cols + cols) * BLOCK_M  # [BLOCK_K]
        if TRANS_STORE:  # transpose in registers, store rows of qt[pid_m]
            qc_t = tl.trans(qc.to(qt_ptr.dtype.element_ty))  # [BLOCK_K, BLOCK_M]
            qt_offs = qt_cols[:, None] + tile_rows[None, :]
            tl.store(qt_ptr + qt_offs, qc_t, mask=col_ok[:, None])
        else:  # store through transposed offsets; Triton picks the store layout
            qt_offs = qt_cols[None, :] + tile_rows[:, None]
            tl.store(qt_ptr + qt_offs, qc.to(qt_ptr.dtype.element_ty), mask=col_ok[None, :])
        # st is [T, K]: one coalesced row per tile.
        _store_scale(st_ptr, pid_m.to(tl.int64) * num_cols + cols, kc, col_ok, E8M0)


# Dual (rows + transposed) kernel: one program per 128-row tile × 128 columns, reading x
# once. The grid runs column tiles fastest, so programs that run together share rows (and
# the sectors of their row scales). Rows-only: BLOCK_M rows × COL_TILES tiles per program.
# H200 (bench_ops_fp8.py, [65536, 4096] bf16): rows-only 194 us (1.00x copy bandwidth) for
# 8-32 rows × 4-16 tiles, 200 us with one tile per program (the old kernel: 260 us with
# strided scale stores). Dual, store through transposed offsets: 330 us at 4 warps (0.78x
# copy), 401 at 8; with an explicit register transpose (dual_trans_store) 493 and 430; the
# earlier kernel (row tiles fastest) 417 at 4 warps. All four variants were bit-exact; the
# explicit fp8 transpose is the pattern that once gave wrong bytes in the 128×128 kernel
# below, so it stays off. Also bit-exact and slower on the H200 ([131072, 2048], 4 warps):
# transposing the fp32 tile before the column quantization, 523 us (461 at 8 warps)
# against 359; a TMA store of each transposed [128, 128] block, 511 us (the fused SwiGLU
# forward 317 against 251 us, its backward 887 against 707). At 4 warps ptxas gives this
# kernel 255 registers and spills 1.6 KB (the whole fp32 tile is 128 values per thread),
# so 2 programs share an SM. Measured and not kept, all bit-exact ([131072, 2048], 359-362
# us here): walking the tile in 16-64-row pieces twice (rows and the column amax, then the
# columns from L2; 64-213 registers, no spills) ran 527-1632 us, the pieces' transposed
# stores and serial loads costing more than the spills; int32 offsets from per-tile base
# pointers (616 B of spills) ran 487 us, having lost the stores' alignment facts; keeping
# the tile in bf16 (amaxes in bf16, fp32 only per product; bit-exact) ran 378-439 us against
# 322-343, the conversions done twice costing more than the halved live tile saved.
# Also measured and not kept (H200, 2026-11-30, library 322-345 us here): Gluon kernels with
# explicit layouts (16 or 8 rows x 8-16 columns per thread, registers walking rows for the
# transposed store, so it writes 8-16-byte vectors with no shared-memory conversion; no
# spills; not the kernel of mt_ops.fp8_quant_gluon, which packs 4 rows per 32-bit word in
# registers and writes the later tile-major layout) ran 354-578 us; a persistent kernel
# reading tiles through pipelined TMA loads
# (1-3 stages, 1-3 programs per SM) 520-853 us; 8 or 16 warps, or 4 warps capped at 128
# registers (4 programs per SM), 350-640 us. Nsight Compute on the library kernel: 74% SM
# and 68% memory throughput, 12 warps per SM (163 registers); dropping the ±448 clamps cut
# its instructions from 20 to 16 per element and left its time unchanged.
# On Hopper the dual quantization runs the Gluon kernel of mt_ops.fp8_quant_gluon
# ("dual_gluon"; its docstring has the measurements); the Triton kernel here serves other
# GPUs, the interpreter on CPU and benchmarks that switch it off. The timings above were
# taken with the earlier transposed layout ([K, 128·T]).
QUANT_CONFIG = {
    "rows_block_m": 8, "rows_col_tiles": 8, "rows_warps": 4, "dual_warps": 4,
    "dual_trans_store": False, "dual_gluon": True,
}  # fmt: skip


@triton.jit
def _tile_pointers(
    tile_start_ptr, tile_end_ptr, num_rows, num_cols, num_col_tiles,
    SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program id → (row tile, column tile), the tile's rows (int64) and columns, masks."""
    pid = tl.program_id(0)
    pid_k = pid % num_col_tiles
    pid_m = pid // num_col_tiles
    row_start, row_end = _tile_rows(tile_start_ptr, tile_end_ptr, pid_m, num_rows,
                                    SEGMENTED, BLOCK_M)  # fmt: skip
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    return pid_m, pid_k, rows.to(tl.int64), rows < row_end, cols, cols < num_cols


@triton.jit
def _quant_1x128_dual_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, tile_start_ptr, tile_end_ptr, src_row_ptr,
    row_weight_ptr, num_rows, num_cols, stride_x, num_col_tiles,
    ROWWISE: tl.constexpr, SEGMENTED: tl.constexpr, E8M0: tl.constexpr,
    GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TRANS_STORE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, rows64, row_ok, cols, col_ok = _tile_pointers(
        tile_start_ptr, tile_end_ptr, num_rows, num_cols, num_col_tiles,
        SEGMENTED, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    src64 = rows64
    if GATHER:  # row r of the result is row src[r] of x (a fused MoE permute)
        src64 = tl.load(src_row_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    x_ptrs = x_ptr + src64[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if WEIGHTED:  # scaled and rounded to x's dtype first, as a weighted copy would be
        w = tl.load(row_weight_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        x = (w[:, None] * x.to(tl.float32)).to(x_ptr.dtype.element_ty)
    _quantize_store_dual(
        x.to(tl.float32), rows64, row_ok, cols, col_ok, pid_m, pid_k, q_ptr, s_ptr, qt_ptr,
        st_ptr, num_cols, num_col_tiles, ROWWISE, True, E8M0, BLOCK_M, BLOCK_K,
        TRANS_STORE,
    )  # fmt: skip


# Rows-only kernel: one program quantizes BLOCK_M rows × COL_TILES 1×128 tiles, loaded as
# [BLOCK_M, COL_TILES, 128], so each row's scales are written as one contiguous run.
@triton.jit
def _quant_1x128_rows_kernel(
    x_ptr, q_ptr, s_ptr, num_rows, num_cols, stride_x, num_col_tiles, num_col_groups,
    E8M0: tl.constexpr, BLOCK_M: tl.constexpr, COL_TILES: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_c = pid % num_col_groups
    pid_m = pid // num_col_groups
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tiles = pid_c * COL_TILES + tl.arange(0, COL_TILES)
    lanes = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)[:, None, None]
    cols = tiles[None, :, None] * BLOCK_K + lanes[None, None, :]  # [1, C, 128]
    mask = (rows64 < num_rows) & (cols < num_cols)
    x = tl.load(x_ptr + rows64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    k = _pow2_exponent_tl(tl.max(tl.abs(x), axis=2))  # [BLOCK_M, C]
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    q = x * inv[:, :, None]
    tl.store(q_ptr + rows64 * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    s_rows = rows.to(tl.int64)[:, None]
    s_mask = (s_rows < num_rows) & (tiles[None, :] < num_col_tiles)
    _store_scale(s_ptr, s_rows * num_col_tiles + tiles[None, :], k, s_mask, E8M0)


def _check_2d(x: Tensor, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"{what} shape ({tuple(x.shape)}) must be 2-D [M, K]; flatten leading dims"
        )
    # An empty tensor (autograd's gradient of an empty output has strides (0, 0)) or a
    # single column reads no neighbouring element: any stride is fine, and .contiguous()
    # would not change it.
    if x.stride(-1) != 1 and x.numel() > 0 and x.shape[-1] > 1:
        raise ValueError(
            f"{what} must have a contiguous last dim (strides {x.stride()}); call .contiguous()"
        )


def _launch_1x128(x_MK, tiles, rowwise, colwise, scale_format, source_rows=None,
                  row_weights=None):  # fmt: skip
    if not colwise and (source_rows is not None or row_weights is not None):
        raise ValueError("source_rows and row_weights need the dual kernel (colwise=True)")
    num_rows = x_MK.shape[0] if source_rows is None else source_rows.shape[0]
    num_cols = x_MK.shape[1]
    dev = x_MK.device
    num_col_tiles = cdiv(num_cols, BLOCK)
    e8m0 = scale_format == "e8m0"
    q = torch.empty((num_rows, num_cols) if rowwise else (0,), dtype=_FP8, device=dev)
    s = _row_scales(num_rows, num_cols, scale_format, dev) if rowwise else _empty_scales(
        (0,), scale_format, dev)  # fmt: skip
    cfg = QUANT_CONFIG
    if not colwise:
        # (At least 1: a [M, 0] input has no column tile, and a 0 would divide by zero.)
        col_tiles = min(cfg["rows_col_tiles"], triton.next_power_of_2(max(num_col_tiles, 1)))
        num_col_groups = cdiv(num_col_tiles, col_tiles)
        launch(
            _quant_1x128_rows_kernel,
            (cdiv(num_rows, cfg["rows_block_m"]) * num_col_groups,),
            x_MK, q, _scale_storage(s), num_rows, num_cols, x_MK.stride(0), num_col_tiles,
            num_col_groups, E8M0=e8m0, BLOCK_M=cfg["rows_block_m"], COL_TILES=col_tiles,
            BLOCK_K=BLOCK, num_warps=cfg["rows_warps"],
        )  # fmt: skip
        return Fp8Quantized(q, s), None
    segmented = tiles is not None
    num_row_tiles = tiles.num_tiles if segmented else cdiv(num_rows, BLOCK)
    qt, st = _transposed_outputs(num_row_tiles, num_cols, scale_format, dev)
    dummy = torch.empty(1, dtype=torch.int32, device=dev)  # never read (no kernel to fill it)
    from mt_ops import fp8_quant_gluon  # noqa: PLC0415 - it builds on this module's helpers

    if rowwise and cfg["dual_gluon"] and fp8_quant_gluon.supported(x_MK):
        if num_row_tiles * num_col_tiles > 0:
            fp8_quant_gluon.launch_dual(
                x_MK, q, _scale_storage(s), qt, _scale_storage(st),
                tiles.start_T if segmented else dummy, tiles.end_T if segmented else dummy,
                dummy if source_rows is None else source_rows,
                dummy if row_weights is None else row_weights,
                num_rows, num_row_tiles, segmented, e8m0, source_rows is not None,
                row_weights is not None,
            )  # fmt: skip
        return Fp8Quantized(q, s), Fp8Quantized(qt, st)
    launch(
        _quant_1x128_dual_kernel, (num_row_tiles * num_col_tiles,),
        x_MK, q, _scale_storage(s), qt, _scale_storage(st),
        tiles.start_T if segmented else dummy, tiles.end_T if segmented else dummy,
        dummy if source_rows is None else source_rows,
        dummy if row_weights is None else row_weights,
        num_rows, num_cols, x_MK.stride(0), num_col_tiles,
        ROWWISE=rowwise, SEGMENTED=segmented, E8M0=e8m0, GATHER=source_rows is not None,
        WEIGHTED=row_weights is not None, BLOCK_M=BLOCK, BLOCK_K=BLOCK,
        TRANS_STORE=cfg["dual_trans_store"], num_warps=cfg["dual_warps"],
    )  # fmt: skip
    return Fp8Quantized(q, s), Fp8Quantized(qt, st)


def quantize_1x128(x_MK: Tensor, *, scale_format: ScaleFormat = "fp32") -> Fp8Quantized:
    """Quantizes each 1×128 tile of every row (activations, output gradients).

    Args:
        x_MK: [M, K] float tensor; K need not be a multiple of 128 (the last tile is short).
        scale_format: ``"fp32"`` or ``"e8m0"``.

    Returns:
        ``data`` fp8 [M, K] and ``scale`` [M, ceil(K / 128)].
    """
    _check_scale_format(scale_format)
    _check_2d(x_MK, "x")
    if not use_kernels(x_MK):
        return quantize_1x128_reference(x_MK, scale_format=scale_format)
    return _launch_1x128(x_MK, None, True, False, scale_format)[0]


def quantize_1x128_dual(
    x_MK: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
    source_rows: Tensor | None = None,
    row_weights: Tensor | None = None,
) -> tuple[Fp8Quantized, Fp8Quantized]:
    """Quantizes x by 1×128 row tiles and xᵀ by 128-row tiles, reading x once.

    With ``source_rows`` and ``row_weights`` it quantizes ``(w · x[source_rows])`` rounded
    to x's dtype, the tensor a gather (MoE permute) and a weighted copy would write, without
    writing it.

    Args:
        x_MK: [M, K] float tensor.
        tiles: Row tiles that restart at each group (expert); None: plain 128-row tiles.
        scale_format: ``"fp32"`` or ``"e8m0"``.
        source_rows: Integer [M'], the row of x that becomes each row of the result (rows
            may repeat; each in [0, M), which the GPU kernel does not check); None: x's
            rows in order (M' = M).
        row_weights: Float [M'], a factor for each row of the result; None: 1.

    Returns:
        ``(rowwise, transposed)``: rowwise data [M', K] with scales [M', ceil(K/128)], and
        tile-major transposed data [T, K, 128] with scales [T, K]
        (T = row tiles, or ceil(M'/128) without ``tiles``; padding and unused slots hold 0
        with scale 1). See the module docstring.
    """
    _check_scale_format(scale_format)
    _check_2d(x_MK, "x")
    _check_row_options(x_MK, source_rows, row_weights, tiles)
    if not use_kernels(x_MK):
        return quantize_1x128_dual_reference(
            x_MK, tiles=tiles, scale_format=scale_format, source_rows=source_rows,
            row_weights=row_weights,
        )  # fmt: skip
    return _launch_1x128(x_MK, tiles, True, True, scale_format, source_rows, row_weights)


def _check_row_options(
    x_MK: Tensor,
    source_rows: Tensor | None,
    row_weights: Tensor | None,
    tiles: RowTiles | None = None,
):
    num_rows = x_MK.shape[0] if source_rows is None else source_rows.shape[0]
    if tiles is not None and tiles.num_rows != num_rows:
        raise ValueError(
            f"tiles cover {tiles.num_rows} rows but the result has {num_rows}; build them "
            "with row_tiles(tokens_per_expert, num_rows) for the rows quantized"
        )
    if source_rows is not None and (source_rows.dim() != 1 or source_rows.is_floating_point()):
        raise ValueError(
            f"source_rows ({source_rows.dtype}, shape {tuple(source_rows.shape)}) must be a "
            "1-D integer tensor of x's row indices"
        )
    if row_weights is not None and tuple(row_weights.shape) != (num_rows,):
        raise ValueError(
            f"row_weights shape ({tuple(row_weights.shape)}) must be [{num_rows}], one "
            "factor per row of the result"
        )


def _launch_1x128_kernel_for_test(
    x_MK, tiles=None, scale_format: ScaleFormat = "fp32", *, rows_only: bool = False,
    source_rows=None, row_weights=None,
):  # fmt: skip
    """Runs the dual (or rows-only) kernel on any device (interpreter on CPU); tests use it."""
    return _launch_1x128(x_MK, tiles, True, not rows_only, scale_format, source_rows, row_weights)


def _pow2_exponent(amax: Tensor) -> Tensor:
    """Smallest k with amax / 2**k <= 448, from the fp32 bits (see module docstring)."""
    bits = amax.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).int()
    return torch.where(amax == 0, 0, k.clamp_min(-126))


def _encode(k: Tensor, scale_format: ScaleFormat) -> Tensor:
    if scale_format == "e8m0":
        return (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return ((k + 127) << 23).int().view(torch.float32)


def _pow2(k: Tensor) -> Tensor:
    return ((k + 127) << 23).int().view(torch.float32)


def _cast(x: Tensor) -> Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(_FP8)


def quantize_1x128_reference(x_MK: Tensor, *, scale_format: ScaleFormat = "fp32") -> Fp8Quantized:
    """Reference of :func:`quantize_1x128` in plain PyTorch (same arguments and results)."""
    _check_scale_format(scale_format)
    num_rows, num_cols = x_MK.shape
    num_col_tiles = cdiv(num_cols, BLOCK)
    x = torch.nn.functional.pad(x_MK.float(), (0, num_col_tiles * BLOCK - num_cols))
    x_MCB = x.view(num_rows, num_col_tiles, BLOCK)
    k_MC = _pow2_exponent(x_MCB.abs().amax(-1) if num_rows else x_MCB.new_zeros(0, num_col_tiles))
    q = _cast(x_MCB * _pow2(-k_MC)[..., None]).view(num_rows, num_col_tiles * BLOCK)[:, :num_cols]
    return Fp8Quantized(q.contiguous(), _encode(k_MC, scale_format))


def _tile_of_row(tiles: RowTiles) -> Tensor:
    lengths_T = (tiles.end_T - tiles.start_T).long()
    slots_T = torch.arange(tiles.num_tiles, device=lengths_T.device)
    return torch.repeat_interleave(slots_T, lengths_T)


def quantize_1x128_dual_reference(
    x_MK: Tensor,
    *,
    tiles: RowTiles | None = None,
    scale_format: ScaleFormat = "fp32",
    source_rows: Tensor | None = None,
    row_weights: Tensor | None = None,
) -> tuple[Fp8Quantized, Fp8Quantized]:
    """Reference of :func:`quantize_1x128_dual` in plain PyTorch (same arguments and results)."""
    _check_scale_format(scale_format)
    _check_row_options(x_MK, source_rows, row_weights, tiles)
    if source_rows is not None:
        x_MK = x_MK.index_select(0, source_rows)
    if row_weights is not None:
        x_MK = (row_weights.float()[:, None] * x_MK.float()).to(x_MK.dtype)
    rowwise = quantize_1x128_reference(x_MK, scale_format=scale_format)
    num_rows, num_cols = x_MK.shape
    if tiles is None:
        tiles = row_tiles(torch.tensor([num_rows], device=x_MK.device), num_rows)
        tiles = RowTiles(  # plain tiles: drop the one spare slot of the single group
            tiles.start_T[: cdiv(num_rows, BLOCK)], tiles.end_T[: cdiv(num_rows, BLOCK)],
            tiles.group_T[: cdiv(num_rows, BLOCK)], tiles.group_first_tile_G, num_rows,
        )  # fmt: skip
    tile_R = _tile_of_row(tiles)  # [M]
    if tile_R.numel() != num_rows:  # (the GPU kernel cannot check this without a host sync)
        raise ValueError(
            f"the row tiles' groups hold {tile_R.numel()} rows but the result has {num_rows}; "
            "tokens_per_expert must sum to the rows"
        )
    absx_MK = x_MK.float().abs()
    amax_TK = torch.zeros(tiles.num_tiles, num_cols, device=x_MK.device)
    amax_TK.scatter_reduce_(0, tile_R[:, None].expand(num_rows, num_cols), absx_MK, "amax")
    k_TK = _pow2_exponent(amax_TK)
    q_MK = _cast(x_MK.float() * _pow2(-k_TK)[tile_R])
    padded_TKB = torch.zeros(tiles.num_tiles, num_cols, BLOCK, dtype=_FP8, device=x_MK.device)
    padded_TKB[tile_R, :, _row_in_tile(tiles, tile_R)] = q_MK
    return rowwise, Fp8Quantized(padded_TKB, _encode(k_TK, scale_format))


def _row_in_tile(tiles: RowTiles, tile_R: Tensor) -> Tensor:
    """Position of each row within its tile (the last index of the transposed data)."""
    rows_R = torch.arange(tile_R.numel(), device=tile_R.device)
    return rows_R - tiles.start_T.long()[tile_R]


# One program per 128×128 block of one group's weight. With TRANSPOSE the program also writes
# the block's transpose (for dgrad; a 128×128 block's scale is symmetric), quantized from a
# second, transposed load of the block, which the first load has just brought into L2. H200
# ([128, 1536, 2048] fp32, both copies): 617 us = 0.92x copy bandwidth at 8 warps, against
# 2710 us when PyTorch transposed the fp8 result. Storing the quantized tile a second time
# through transposed offsets ran 561 us but gave wrong bytes at this size (bit-exact at
# [3, 200, 330]), both from Triton and from a Gluon kernel with explicit layouts
# (bench_ops_fp8_check.py keeps checking the transposed result against the reference).
@triton.jit
def _quant_128x128_kernel(
    w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, num_rows, num_cols, num_row_blocks, num_col_blocks,
    E8M0: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    base = g * num_rows * num_cols
    w = tl.load(w_ptr + base + rows[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    k = _pow2_exponent_tl(amax)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    q = (w * inv).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + base + rows[:, None] * num_cols + cols[None, :], q, mask=mask)
    num_blocks = num_row_blocks * num_col_blocks
    _store_scale(s_ptr, g * num_blocks + pid_n * num_col_blocks + pid_k, k, None, E8M0)
    if TRANSPOSE:  # qt [K, N]: row c of the block is column c of w
        mask_t = (cols < num_cols)[:, None] & (rows < num_rows)[None, :]
        w_t = tl.load(w_ptr + base + rows[None, :] * num_cols + cols[:, None], mask=mask_t,
                      other=0.0)  # fmt: skip
        q_t = (w_t.to(tl.float32) * inv).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + base + cols[:, None] * num_rows + rows[None, :], q_t, mask=mask_t)
        _store_scale(st_ptr, g * num_blocks + pid_k * num_row_blocks + pid_n, k, None, E8M0)


def quantize_128x128(
    w: Tensor, *, scale_format: ScaleFormat = "fp32", transpose: bool = False
) -> tuple[Fp8Quantized, Fp8Quantized | None]:
    """Quantizes each 128×128 block of a weight [N, K] or stacked weights [E, N, K].

    Args:
        w: Weight [N, K] or [E, N, K], contiguous.
        scale_format: ``"fp32"`` or ``"e8m0"``.
        transpose: Also return the quantized transpose (for dgrad): the same blocks and
            scales, transposed, written by the same pass.

    Returns:
        ``(blocks, transposed)``: data like ``w`` with scales [(E,) ceil(N/128), ceil(K/128)],
        and, when ``transpose``, data [(E,) K, N] with scales [(E,) ceil(K/128), ceil(N/128)]
        (else None).
    """
    _check_scale_format(scale_format)
    if w.dim() not in (2, 3) or not w.is_contiguous():
        raise ValueError(
            f"w shape ({tuple(w.shape)}) must be a contiguous [N, K] or [E, N, K]; "
            "call .contiguous()"
        )
    if not use_kernels(w):
        return quantize_128x128_reference(w, scale_format=scale_format, transpose=transpose)
    return _launch_128x128(w, scale_format, transpose)


def _launch_128x128(w, scale_format, transpose):
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    groups, num_rows, num_cols = w3.shape
    nb, kb = cdiv(num_rows, BLOCK), cdiv(num_cols, BLOCK)
    q = torch.empty(w3.shape, dtype=_FP8, device=w.device)
    s = _empty_scales((groups, nb, kb), scale_format, w.device)
    qt_shape = (groups, num_cols, num_rows) if transpose else (0,)
    qt = torch.empty(qt_shape, dtype=_FP8, device=w.device)
    st = _empty_scales((groups, kb, nb) if transpose else (0,), scale_format, w.device)
    launch(
        _quant_128x128_kernel, (nb, kb, groups), w3, q, _scale_storage(s), qt,
        _scale_storage(st), num_rows, num_cols, nb, kb, E8M0=scale_format == "e8m0",
        TRANSPOSE=transpose, BLOCK_N=BLOCK, num_warps=8,
    )  # fmt: skip
    squeeze = (lambda t: t[0]) if w.dim() == 2 else (lambda t: t)
    blocks = Fp8Quantized(squeeze(q), squeeze(s))
    if not transpose:
        return blocks, None
    return blocks, Fp8Quantized(squeeze(qt), squeeze(st))


def quantize_128x128_reference(
    w: Tensor, *, scale_format: ScaleFormat = "fp32", transpose: bool = False
) -> tuple[Fp8Quantized, Fp8Quantized | None]:
    """Reference of :func:`quantize_128x128` in plain PyTorch (same arguments and results)."""
    _check_scale_format(scale_format)
    w3 = w.float() if w.dim() == 3 else w.float().unsqueeze(0)
    groups, num_rows, num_cols = w3.shape
    nb, kb = cdiv(num_rows, BLOCK), cdiv(num_cols, BLOCK)
    padded = torch.nn.functional.pad(w3, (0, kb * BLOCK - num_cols, 0, nb * BLOCK - num_rows))
    blocks = padded.view(groups, nb, BLOCK, kb, BLOCK)
    k_GNK = _pow2_exponent(blocks.abs().amax(dim=(2, 4)))  # [G, nb, kb]
    q = _cast(blocks * _pow2(-k_GNK)[:, :, None, :, None]).view(groups, nb * BLOCK, kb * BLOCK)
    q = q[:, :num_rows, :num_cols].contiguous()
    s = _encode(k_GNK, scale_format)
    squeeze = (lambda t: t[0]) if w.dim() == 2 else (lambda t: t)
    out = Fp8Quantized(squeeze(q), squeeze(s))
    if not transpose:
        return out, None
    qt = q.transpose(1, 2).contiguous()
    st = s.transpose(1, 2).contiguous()
    return out, Fp8Quantized(squeeze(qt), squeeze(st))


def dequantize_1x128(q: Fp8Quantized) -> Tensor:
    """fp32 values of a 1×128-quantized [M, K] tensor (exact)."""
    num_cols = q.data.shape[-1]
    scale = scale_to_float(q.scale).repeat_interleave(BLOCK, dim=-1)[..., :num_cols]
    return q.data.float() * scale


def dequantize_128x128(q: Fp8Quantized) -> Tensor:
    """fp32 values of a 128×128-quantized [(E,) N, K] tensor (exact)."""
    num_rows, num_cols = q.data.shape[-2:]
    scale = scale_to_float(q.scale).repeat_interleave(BLOCK, dim=-2)[..., :num_rows, :]
    scale = scale.repeat_interleave(BLOCK, dim=-1)[..., :num_cols]
    return q.data.float() * scale


def dequantize_tiles_transposed(q: Fp8Quantized, tiles: RowTiles | None, num_rows: int) -> Tensor:
    """fp32 values [K, M] of the (tile-major) transposed half of :func:`quantize_1x128_dual`.

    Args:
        q: The transposed half: data [T, K, 128], scales [T, K].
        tiles: The row tiles it was quantized with (None: plain 128-row tiles).
        num_rows: M.

    Returns:
        ``xᵀ`` as fp32 [K, M], exactly.
    """
    rows_R = torch.arange(num_rows, device=q.data.device)
    if tiles is None:
        tile_R, pos_R = rows_R // BLOCK, rows_R % BLOCK
    else:
        tile_R = _tile_of_row(tiles)
        pos_R = _row_in_tile(tiles, tile_R)
    return (q.data[tile_R, :, pos_R].float() * scale_to_float(q.scale)[tile_R]).T
