"""Block-scaled FP8 GEMMs behind one interface: DeepGEMM, cuBLAS, our Triton kernels, emulation.

Legend: M rows (tokens), N output features, K contraction dim, G groups (experts),
T row tiles (see :class:`mt_ops.fp8_quant.RowTiles`).

Three products cover a linear layer's training step (y = x Wᵀ):

- fprop ``y = x Wᵀ`` and dgrad ``dx = dy W``: A is 1×128-quantized by rows, B is a
  128×128-quantized weight ([N, K]; for dgrad the weight's quantized transpose);
  :func:`fp8_grouped_gemm` runs G of them over consecutive row groups (experts).
- wgrad ``dW = dyᵀ x``: both operands are tile-major transposed 1×128 quantizations
  ([T, N, 128]: tiles of 128 tokens that restart at each expert), :func:`fp8_grouped_wgrad`.

The semantics are defined by the *emulation*: dequantize exactly (scales are powers of two)
and multiply in fp32. Kernels accumulate each 128-wide K block on the tensor cores and
apply the two scales per block in fp32 (DeepSeek-V3's promotion every 128 elements). Hopper's
FP8 tensor cores add inside a block with fewer mantissa bits than fp32, so fp32 outputs
differ from the emulation by ~1.3e-4 L2-relative (measured on the H200; 4.6e-5 even when
promoting after every instruction, at a fifth of the speed); bf16 outputs agree up to
their own rounding.

Backends, chosen once per device and logged once (``backend=`` on a call overrides, so does
the environment variable ``MT_OPS_FP8_BACKEND``):

- ``"deepgemm"``: when the ``deep_gemm`` package imports (built from source by the user);
  used for dense GEMMs through ``deep_gemm.fp8_gemm_nt``; grouped products use Triton.
- ``"torch"``: cuBLAS blockwise-scaled ``torch._scaled_mm`` for dense fprop/dgrad with
  K a multiple of 512, once a one-time probe finds that it runs and computes right (on the
  H200, 16384×4096×4096: 1.1 PFLOP/s, 1.67× BF16 and 1.41× our Triton kernel), and for
  the dense wgrad where the Hopper kernels cannot run (one group; both operands 1×128
  along the tokens, its own probe; cuBLAS reads a side-by-side copy of the tile-major
  tiles). On the H200 the dense wgrad takes the Hopper kernel: 4096×2048 over 16k tokens
  in 289 us, against 508 for cuBLAS with the copy (2048×2048: 142 against 302; over 4k
  tokens: 118 against 147). cuBLAS ran the old tile-padded layout without a copy in 276 us,
  so the tile-major layout costs this wgrad ~5% while the dual quantizer writing it gained
  10-20% (mt_ops.fp8_quant_gluon); elsewhere (E8M0 scales, other GPUs) the copy is paid.
  Our Triton kernels serve other dense shapes and grouped products (PyTorch's grouped FP8
  path is rowwise only).
- ``"triton"``: our Triton kernels for everything (on Hopper, the grouped products take the
  warp-specialized Gluon kernels of :mod:`mt_ops.fp8_gemm_hopper`, which compute the same
  bits faster).
- ``"emulation"``: dequantize + fp32 matmul (the CPU default).
"""

import logging
import math
import os
from functools import cache

import torch
from torch import Tensor

from mt_ops import fp8_gemm_hopper
from mt_ops._dtypes import autocast_off
from mt_ops._triton import TensorDescriptor, cdiv, launch, num_sms, tl, triton
from mt_ops.fp8_quant import (
    BLOCK,
    Fp8Quantized,
    RowTiles,
    dequantize_1x128,
    dequantize_128x128,
    dequantize_tiles_transposed,
    scale_to_float,
)

__all__ = [
    "BACKENDS",
    "fp8_backend",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_pair",
    "fp8_grouped_gemm_reference",
    "fp8_grouped_gemm_sum",
    "fp8_grouped_gemm_sum_reference",
    "fp8_grouped_wgrad",
    "fp8_grouped_wgrad_reference",
]

BACKENDS = ("deepgemm", "torch", "triton", "emulation")
_log = logging.getLogger("mt_ops.fp8")


@cache
def _deep_gemm():
    try:
        import deep_gemm  # noqa: PLC0415 - optional extra, built from source

        return deep_gemm
    except ImportError:
        return None


@cache
def _log_choice(device_type: str, backend: str, reason: str) -> None:
    _log.info("mt_ops FP8 GEMM backend on %s: %s (%s)", device_type, backend, reason)


def fp8_backend(device: torch.device, backend: str | None = None) -> str:
    """The FP8 GEMM backend for ``device``: ``backend`` if given, else the best available.

    Args:
        device: Device of the operands.
        backend: An explicit choice from :data:`BACKENDS`, or None for automatic selection
            (``MT_OPS_FP8_BACKEND`` if set, else DeepGEMM → torch → emulation).

    Returns:
        The backend name; the automatic choice is logged once per device type.
    """
    requested = backend or os.environ.get("MT_OPS_FP8_BACKEND") or None
    # Errors name where the choice came from: a caller who passed none set the variable.
    source = "backend" if backend else "MT_OPS_FP8_BACKEND"
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(
                f"FP8 backend {source}={requested!r} must be one of {BACKENDS}, or unset "
                "(None) for the automatic choice"
            )
        if requested != "emulation" and device.type != "cuda":
            raise ValueError(
                f"FP8 backend {source}={requested!r} needs CUDA tensors (got {device}); use "
                "'emulation'"
            )
        if requested == "deepgemm" and _deep_gemm() is None:
            raise ValueError("FP8 backend 'deepgemm' requested but deep_gemm does not import")
        _log_choice(device.type, requested, "requested")
        return requested
    if device.type != "cuda":
        choice, reason = "emulation", "no CUDA device"
    elif _deep_gemm() is not None:
        choice, reason = "deepgemm", "deep_gemm imports"
    else:
        choice, reason = "torch", "cuBLAS blockwise dense + Triton grouped"
    _log_choice(device.type, choice, reason)
    return choice


# --- grouped fprop / dgrad: y[rows of g] = A[rows of g] @ B[g]ᵀ (+ A2 @ B2[g]ᵀ) ------------
# The scale granularity fixes BLOCK_K = 128 and BLOCK_M = 128 (one row tile). BLOCK_N,
# stages and warps are set by bench_ops_fp8.py's sweep on the H200. MAX_IMPRECISE None keeps
# Triton's Hopper default for fp8 dots (tensor-core accumulation inside each 128-wide K block,
# promoted to fp32 per block as in DeepSeek-V3); 32 would promote after every instruction.
# Measured on the H200 (Qwen3 expert shapes): BLOCK_N 128 with a scalar B scale per K step
# ran 617 TFLOP/s; a [BLOCK_N] scale vector (to allow BLOCK_N = 256) cost 16% at 128 and
# BLOCK_N = 256 ran 214; MAX_IMPRECISE = 32 cut the rate 5x for 1.3e-4 -> 4.6e-5 error.
# N_FASTEST orders the 1-D grid with the N blocks of one row tile consecutive, so programs
# running together share their A tile (read once from memory instead of N/128 times) and
# the expert's weight stays in L2: on the H200 (Qwen3 gate fprop, 16k tokens) 574 us
# (718 TFLOP/s) against 664 us with row tiles fastest; 3 or 5 stages ran 586 and 580 us.
GEMM_CONFIG = {"num_stages": 4, "num_warps": 8, "MAX_IMPRECISE": None, "N_FASTEST": True}
# On CUDA the kernels read operand tiles through TMA descriptors (no address arithmetic or
# masks in the loop; out-of-bounds rows and K columns come back as zeros) and the grouped
# GEMM runs persistent (one program per SM walking the tiles in N_FASTEST order). H200,
# 16k tokens, TFLOP/s, pointer loads -> TMA persistent: Qwen3 gate fprop 707 -> 751, down
# 552 -> 573; DeepSeek-V2-Lite 690 -> 735 and 665 -> 699 (non-persistent TMA: 734, 557).
# TMA needs 16-byte aligned rows (K % 16 == 0); other shapes take the pointer loads.
# Tried and not kept (same H200 shapes): flattened persistent loops (tl.range flatten=True)
# and Triton's warp specialization, 0.98-1.01x; two programs per SM, 0.97x; a manually
# software-pipelined promotion (next block's MMA issued before this block's scaling) or two
# K blocks per iteration, 0.65-0.99x.
# Whole 128-row output tiles are written with asynchronous TMA stores, which overlap the next
# tile's main loop (+0-7% on the same shapes, e.g. Qwen3 down fprop 574 -> 612 TFLOP/s).
# Tried and not kept for wgrad: TMA stores and a persistent grid, 0.97-1.05x with BF16 output
# and 0.6x with fp32 output (the fp32 staging tile halves the programs per SM).
# A warp-specialized Gluon kernel with these 128×128 tiles (one TMA producer warp, two
# consumer warpgroups promoting 64 rows each) computed the same bits at 0.95-1.09x; with
# plain accumulation instead of per-block promotion it reached only 1.10-1.30x, so the
# scaling is not the main limit. What was: 128×256 tiles, which mt_ops.fp8_gemm_hopper
# holds in two consumer warpgroups of 128 columns each (HOPPER below).
# Loading the next tile's group and rows while a tile runs (instead of at its start) changed
# nothing (0.93-1.01x), so the per-tile cost is not that dependent-load chain either.
TMA = {"enabled": True, "persistent": True, "store": True}
# On Hopper the grouped products run the warp-specialized Gluon kernels of
# mt_ops.fp8_gemm_hopper (128×256 tiles; 1.2-1.5x these for fprop and dgrad, 1.1-1.4x for
# wgrad on the H200, the same bits); the Triton kernels here serve other GPUs, operands
# TMA cannot read, the interpreter on CPU, and benchmarks that switch this off.
# "pair": a layer's gate and up fprop in one kernel (fp8_grouped_gemm_pair). H200, 16k
# tokens, MLP step profile: DeepSeek-V2-Lite 974 us against 532 + 530 (N = 1408 takes 11
# programs per row tile instead of 12), its MLP step 6.84 against 6.93 ms; Qwen3 694 against
# 357 + 357.
HOPPER = {"enabled": True, "pair": True}


def _use_hopper(*operands: Fp8Quantized, out: Tensor) -> bool:
    return HOPPER["enabled"] and TMA["enabled"] and fp8_gemm_hopper.supported(operands, out)


def _hopper_takes_new(*operands: Fp8Quantized, shape, dtype: torch.dtype) -> bool:
    """:func:`_use_hopper` for a result not yet allocated (so that a route which would not
    use it allocates nothing): a new tensor is contiguous and aligned, so a one-row stand-in
    answers for it, plus the element count that bounds the kernels' offsets."""
    probe = torch.empty((1, shape[-1]), dtype=dtype, device=operands[0].data.device)
    return 0 < math.prod(shape) < 2**31 and _use_hopper(*operands, out=probe)


def _use_tma(*tensors: Tensor) -> bool:
    """Whether TMA can read these FP8 operands: non-empty contiguous CUDA tensors with
    16-byte aligned rows and fewer than 2³¹ rows (TMA coordinates are int32)."""
    return (
        TMA["enabled"]
        and TensorDescriptor is not None
        and all(
            t.is_cuda
            and t.is_contiguous()
            and t.numel() > 0
            and t.shape[-1] % 16 == 0
            and t.data_ptr() % 16 == 0
            and t.numel() // t.shape[-1] < 2**31
            for t in tensors
        )
    )


def _descriptor(data: Tensor, block_rows: int) -> TensorDescriptor:
    """A TMA descriptor over 2-D FP8 ``data`` reading [block_rows, 128] tiles."""
    return TensorDescriptor.from_tensor(data, [block_rows, BLOCK])


@triton.jit
def _scaled_block_loop(
    acc, a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, rows64, row_ok, row_start, cols, col_ok,
    g64, N, K, num_k_blocks, num_n_scale_blocks, pid_n,
    USE_TMA: tl.constexpr, SCALE_E8M0: tl.constexpr, UPCAST: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc += Σ_kb (A_kb B_kbᵀ) · sa_kb · sb_kb`` over the K blocks of one operand pair."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * K + ks[None, :]
    b_ptrs = b_ptr + g64 * N * K + cols[:, None].to(tl.int64) * K + ks[None, :]
    b_row = (g64 * N + pid_n * BLOCK_N).to(tl.int32)  # B viewed as [G·N, K] for TMA
    sa_ptrs = sa_ptr + rows64 * num_k_blocks
    # BLOCK_N = 128: one B scale per K step for the whole tile.
    sb_ptrs = sb_ptr + (g64 * num_n_scale_blocks + pid_n) * num_k_blocks
    for kb in range(num_k_blocks):
        if USE_TMA:  # rows past the group feed masked outputs only; past K read as zeros
            a = a_desc.load([row_start, kb * BLOCK_K])
            b = b_desc.load([b_row, kb * BLOCK_K])
        else:
            k_ok = ks < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        sa = tl.load(sa_ptrs + kb, mask=row_ok, other=0)
        sb = tl.load(sb_ptrs + kb)
        if SCALE_E8M0:
            sa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            sb = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if UPCAST:  # the interpreter multiplies fp8 bit patterns; upcast first there
            partial = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        else:
            partial = tl.dot(a, tl.trans(b), max_num_imprecise_acc=MAX_IMPRECISE)
        acc += partial * (sa[:, None] * sb)
    return acc


@triton.jit
def _fp8_grouped_gemm_kernel(
    a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, a2_ptr, a2_desc, sa2_ptr, b2_ptr, b2_desc,
    sb2_ptr, c_ptr, c_desc, tile_start_ptr, tile_end_ptr, tile_group_ptr,
    N, K, K2, num_k_blocks, num_k2_blocks, num_n_scale_blocks, num_n_blocks, num_tiles,
    num_groups, num_programs,
    HAS_SECOND: tl.constexpr, N_FASTEST: tl.constexpr, USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr, SCALE_E8M0: tl.constexpr, UPCAST: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program p computes output tiles p, p + num_programs, ... (one each unless persistent).
    for pid in range(tl.program_id(0), num_tiles * num_n_blocks, num_programs):
        if N_FASTEST:
            pid_n = pid % num_n_blocks
            pid_t = pid // num_n_blocks
        else:
            pid_t = pid % num_tiles
            pid_n = pid // num_tiles
        g = tl.load(tile_group_ptr + pid_t)
        if g < num_groups:  # tile slots past the last group are unused
            row_start = tl.load(tile_start_ptr + pid_t)
            row_end = tl.load(tile_end_ptr + pid_t)
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            col_ok = cols < N
            rows64 = rows.to(tl.int64)
            g64 = g.to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _scaled_block_loop(
                acc, a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, rows64, row_ok, row_start,
                cols, col_ok, g64, N, K, num_k_blocks, num_n_scale_blocks, pid_n, USE_TMA,
                SCALE_E8M0, UPCAST, MAX_IMPRECISE, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            if HAS_SECOND:
                acc = _scaled_block_loop(
                    acc, a2_ptr, a2_desc, sa2_ptr, b2_ptr, b2_desc, sb2_ptr, rows64, row_ok,
                    row_start, cols, col_ok, g64, N, K2, num_k2_blocks, num_n_scale_blocks,
                    pid_n, USE_TMA, SCALE_E8M0, UPCAST, MAX_IMPRECISE, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            if TMA_STORE and row_end - row_start == BLOCK_M:
                # A whole row tile: an asynchronous TMA store (columns past N are clipped)
                # overlaps the next tile's main loop. A partial tile ends at its group's
                # last row and must not write the next group's rows: masked stores.
                c_desc.store([row_start, pid_n * BLOCK_N], acc.to(c_desc.dtype))
            else:
                c_ptrs = c_ptr + rows64[:, None] * N + cols[None, :]
                c_mask = row_ok[:, None] & col_ok[None, :]
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _check_grouped(a: Fp8Quantized, b: Fp8Quantized, tiles: RowTiles) -> None:
    if a.data.dim() != 2 or b.data.dim() != 3 or a.data.shape[1] != b.data.shape[2]:
        raise ValueError(
            f"A data shape ({tuple(a.data.shape)}) and B data shape ({tuple(b.data.shape)}) "
            "must be [M, K] and [G, N, K]"
        )
    if a.data.shape[0] != tiles.num_rows:
        raise ValueError(
            f"A has {a.data.shape[0]} rows but the tiles cover {tiles.num_rows}; build the "
            "tiles with row_tiles(tokens_per_expert, num_rows=A rows)"
        )
    num_groups = tiles.group_first_tile_G.numel() - 1
    if num_groups != b.data.shape[0]:
        # A group without a weight would leave its rows unwritten (the kernel's output is
        # torch.empty) or zero (the emulation).
        raise ValueError(
            f"the tiles have {num_groups} groups but B holds {b.data.shape[0]} weights; build "
            "the tiles from one count per expert of B"
        )
    _check_scale_formats(a, b)


def _check_scale_formats(a: Fp8Quantized, b: Fp8Quantized) -> None:
    if a.scale.dtype != b.scale.dtype:
        raise ValueError(
            f"A scale dtype ({a.scale.dtype}) must equal B scale dtype ({b.scale.dtype}); "
            "quantize both operands with the same scale_format"
        )


def _grouped_gemm_triton(a, b, tiles, out_dtype, second=None):
    num_rows, k_dim = a.data.shape
    num_groups, n_dim, _ = b.data.shape
    out = torch.empty(num_rows, n_dim, dtype=out_dtype, device=a.data.device)
    if num_rows == 0 or n_dim == 0:  # e.g. an expert-parallel rank that received no tokens
        return out
    if _use_hopper(a, b, *(second or ()), out=out):
        return fp8_gemm_hopper.grouped_gemm(a, b, tiles, out, second)
    e8m0 = a.scale.dtype == torch.float8_e8m0fnu

    def storage(q):
        return q.scale.view(torch.uint8) if e8m0 else q.scale

    a2, b2 = second if second is not None else (a, b)
    k2_dim = a2.data.shape[1]
    num_n_blocks = cdiv(n_dim, BLOCK)
    num_outputs = tiles.num_tiles * num_n_blocks
    cfg = GEMM_CONFIG
    use_tma = _use_tma(a.data, b.data, a2.data, b2.data)
    descs = [None] * 4
    if use_tma:  # B viewed as [G·N, K]
        operands = (a.data, b.data.view(-1, k_dim), a2.data, b2.data.view(-1, k2_dim))
        descs = [_descriptor(t, BLOCK) for t in operands]
    # Whole row tiles of a 16-bit output take TMA stores when its rows are 16-byte aligned
    # (fp32 outputs keep pointer stores: their 64 KiB staging tile was not measured).
    tma_store = use_tma and TMA["store"] and out.element_size() == 2 and (n_dim * 2) % 16 == 0
    c_desc = TensorDescriptor.from_tensor(out, [BLOCK, BLOCK]) if tma_store else None
    num_programs = num_outputs
    if use_tma and TMA["persistent"]:
        num_programs = min(num_outputs, num_sms(a.data.device))
    launch(
        _fp8_grouped_gemm_kernel, (max(num_programs, 1),),
        a.data, descs[0], storage(a), b.data, descs[1], storage(b),
        a2.data, descs[2], storage(a2), b2.data, descs[3], storage(b2),
        out, c_desc, tiles.start_T, tiles.end_T, tiles.group_T,
        n_dim, k_dim, k2_dim, cdiv(k_dim, BLOCK), cdiv(k2_dim, BLOCK), cdiv(n_dim, BLOCK),
        num_n_blocks, tiles.num_tiles, num_groups, max(num_programs, 1),
        HAS_SECOND=second is not None, N_FASTEST=cfg["N_FASTEST"], USE_TMA=use_tma,
        TMA_STORE=tma_store, SCALE_E8M0=e8m0, UPCAST=not a.data.is_cuda,
        MAX_IMPRECISE=cfg["MAX_IMPRECISE"], BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


SCALED_MM_PROBE_ERRORS: list[str] = []


# The two cuBLAS blockwise recipes of the "torch" backend: 1×128 row tiles of A times a
# 128×128-block weight (fprop, dgrad), and 1×128 tiles along K on both sides (dense wgrad:
# the transposed token tiles of dy and x).
SCALED_MM_RECIPES = ("1x128,128x128", "1x128,1x128")


@cache
def _scaled_mm_works(device_index: int, recipe: str = "1x128,128x128") -> bool:
    """Whether cuBLAS blockwise ``_scaled_mm`` runs ``recipe`` and computes right here
    (checked once per device and recipe; failures are logged and kept in
    ``SCALED_MM_PROBE_ERRORS``)."""
    # The first call usually comes from inside a forward under autocast, which would compute
    # the fp32 reference product in BF16: its rounding (~1e-3 L2-relative) then fails the
    # check and the process silently keeps the slower kernels.
    with torch.autocast("cuda", enabled=False), torch.no_grad():
        return _probe_scaled_mm(device_index, recipe)


def _probe_scaled_mm(device_index: int, recipe: str) -> bool:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda", device_index)
    a = (torch.randn(256, 512, device=dev, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(256, 512, device=dev, generator=gen) * 8).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-3, 3, (256, 4), device=dev, generator=gen).float())
    weight_blocks = recipe == "1x128,128x128"
    sb_shape = (2, 4) if weight_blocks else (256, 4)
    sb = torch.exp2(torch.randint(-3, 3, sb_shape, device=dev, generator=gen).float())
    b_full = (dequantize_128x128 if weight_blocks else dequantize_1x128)(Fp8Quantized(b, sb))
    expected = dequantize_1x128(Fp8Quantized(a, sa)) @ b_full.T
    try:
        if weight_blocks:
            got = _scaled_mm_call(a, sa, b, sb, torch.float32)
        else:  # the wgrad operands' scales are tile-major: [K blocks, rows]
            got = _scaled_mm_tiles_call(a, sa.T.contiguous(), b, sb.T.contiguous(), torch.float32)
    except RuntimeError as err:
        problem = str(err)[:300]
    else:
        relative = float((got - expected).norm() / expected.norm())
        if relative < 1e-3:  # a wrong layout is off by O(1); FP8 tensor-core accumulation ~1e-4
            return True
        problem = f"relative error {relative:.2e} against the dequantized product"
    SCALED_MM_PROBE_ERRORS.append(f"{recipe}: {problem}")
    _log.warning(
        "cuBLAS blockwise torch._scaled_mm (%s) failed its check on cuda:%d (%s); those FP8 "
        "GEMMs run on the Triton kernels instead", recipe, device_index, problem,
    )  # fmt: skip
    return False


def _scaled_mm_call(a, sa, b, sb, out_dtype):
    # cuBLAS takes B as the [K, N] column-major view of the [N, K] weight, the 1×128 scales
    # M-major ([M, Kb] with stride (1, M)) and the 128×128 scales as the [Kb, Nb] view of
    # the [Nb, Kb] tensor (stride (1, Kb)). With Kb not a multiple of 4 (K % 512 != 0) that
    # view is accepted and computes wrong results on the H200 (PyTorch 2.11, CUDA 13), and
    # padding its stride to 4 is refused, so _dense_torch only takes K % 512 == 0.
    return torch._scaled_mm(a, b.T, scale_a=sa.T.contiguous().T, scale_b=sb.T, out_dtype=out_dtype)


def _dense_torch(a, b, out_dtype):
    m, k = a.data.shape
    n = b.data.shape[1]
    # N % 128: the probe and the GPU tests cover whole 128-column scale blocks only.
    if m % 16 or n % 128 or k % 512 or not _scaled_mm_works(a.data.device.index or 0):
        return None
    return _scaled_mm_call(
        a.data, scale_to_float(a.scale), b.data[0], scale_to_float(b.scale[0]), out_dtype
    )


def _scaled_mm_tiles_call(a, sa_KbN, b, sb_KbK, out_dtype):
    # Both operands 1×128 along the contraction dim: cuBLAS takes A's scales M-major (the
    # transpose view of our tile-major [Kb, N]) and B's as the [Kb, K] tensor itself.
    return torch._scaled_mm(a, b.T, scale_a=sa_KbN.T, scale_b=sb_KbK, out_dtype=out_dtype)


def _tiles_side_by_side(data_TNB: Tensor) -> Tensor:
    """[T, N, 128] tile-major data as the [N, 128·T] matrix of its tiles side by side."""
    num_tiles, n_dim, _ = data_TNB.shape
    return data_TNB.permute(1, 0, 2).reshape(n_dim, num_tiles * BLOCK)


def _wgrad_torch(a_t, b_t, out, out_dtype):
    """Dense (one group) wgrad on cuBLAS, or None where the recipe or shape does not fit."""
    n_dim, k_dim = a_t.data.shape[1], b_t.data.shape[1]
    if n_dim % 16 or k_dim % 16 or not _scaled_mm_works(a_t.data.device.index or 0, "1x128,1x128"):
        return None
    # cuBLAS takes [N, 128·T] matrices: the tile-major blocks side by side (a copy of each
    # operand's fp8 bytes). Unused tile slots hold zeros (scale 1), so the padded
    # contraction adds nothing.
    result = _scaled_mm_tiles_call(
        _tiles_side_by_side(a_t.data), scale_to_float(a_t.scale),
        _tiles_side_by_side(b_t.data), scale_to_float(b_t.scale),
        torch.float32 if out is not None else out_dtype,
    )  # fmt: skip
    return result.unsqueeze(0) if out is None else out.add_(result)


def _dense_deepgemm(a, b, out_dtype):
    out = torch.empty(a.data.shape[0], b.data.shape[1], dtype=out_dtype, device=a.data.device)
    _deep_gemm().fp8_gemm_nt(
        (a.data, scale_to_float(a.scale)), (b.data[0], scale_to_float(b.scale[0])), out
    )
    return out


def fp8_grouped_gemm(
    a: Fp8Quantized,
    b: Fp8Quantized,
    tiles: RowTiles,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> Tensor:
    """``y[rows of g] = A[rows of g] @ B[g]ᵀ`` for block-scaled FP8 operands.

    Args:
        a: 1×128-quantized rows: data [M, K], scales [M, ceil(K/128)].
        b: 128×128-quantized stacked weights: data [G, N, K], scales [G, N/128, K/128].
        tiles: Row tiles of the G groups (:func:`mt_ops.fp8_quant.row_tiles`); G = 1 for a
            dense GEMM.
        out_dtype: Output dtype.
        backend: Backend override (see module docstring).

    Returns:
        ``y`` [M, N] in ``out_dtype``.
    """
    _check_grouped(a, b, tiles)
    choice = fp8_backend(a.data.device, backend)
    if choice == "emulation":
        return fp8_grouped_gemm_reference(a, b, tiles, out_dtype=out_dtype)
    if b.data.shape[0] == 1 and choice in ("torch", "deepgemm"):
        dense = _dense_deepgemm if choice == "deepgemm" else _dense_torch
        out = dense(a, b, out_dtype)
        if out is not None:
            return out
    return _grouped_gemm_triton(a, b, tiles, out_dtype)


def fp8_grouped_gemm_pair(
    a: Fp8Quantized,
    b: Fp8Quantized,
    b2: Fp8Quantized,
    tiles: RowTiles,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(fp8_grouped_gemm(a, b, ...), fp8_grouped_gemm(a, b2, ...))`` (a layer's gate and up
    projections of the same rows); on Hopper, when ``HOPPER["pair"]`` is on, in one kernel
    (mt_ops.fp8_gemm_hopper.grouped_gemm_pair) that reads A once and computes the same
    columns of both weights in one program (same bits)."""
    _check_grouped(a, b, tiles)
    _check_grouped(a, b2, tiles)
    if b.data.shape != b2.data.shape or b.scale.dtype != b2.scale.dtype:
        raise ValueError(
            f"paired weights' shapes ({tuple(b.data.shape)}, {tuple(b2.data.shape)}) and "
            f"scale dtypes ({b.scale.dtype}, {b2.scale.dtype}) must agree; pair a layer's "
            "gate and up projections"
        )
    choice = fp8_backend(a.data.device, backend)
    # As fp8_grouped_gemm routes: one group under "torch" or "deepgemm" takes the dense
    # library GEMM, so the pair does too (two calls below).
    if HOPPER["pair"] and choice != "emulation" and (b.data.shape[0] > 1 or choice == "triton"):
        shape = (a.data.shape[0], b.data.shape[1])
        if _hopper_takes_new(a, b, b2, shape=shape, dtype=out_dtype):
            out = torch.empty(shape, dtype=out_dtype, device=a.data.device)
            return fp8_gemm_hopper.grouped_gemm_pair(a, b, b2, tiles, out, torch.empty_like(out))
    return (
        fp8_grouped_gemm(a, b, tiles, out_dtype=out_dtype, backend=backend),
        fp8_grouped_gemm(a, b2, tiles, out_dtype=out_dtype, backend=backend),
    )


def fp8_grouped_gemm_reference(
    a: Fp8Quantized,
    b: Fp8Quantized,
    tiles: RowTiles,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> Tensor:
    """Exact emulation of :func:`fp8_grouped_gemm`: dequantize, then fp32 matmuls per group."""
    del backend
    _check_grouped(a, b, tiles)
    a_MK = dequantize_1x128(a)
    b_GNK = dequantize_128x128(b)
    out = torch.zeros(a_MK.shape[0], b_GNK.shape[1], dtype=torch.float32, device=a_MK.device)
    starts, ends, groups = tiles.start_T.tolist(), tiles.end_T.tolist(), tiles.group_T.tolist()
    # Autocast off: FP8 backwards run under the training step's autocast, which would
    # multiply the dequantized fp32 operands in BF16 and round fp32 results (a weight
    # gradient, each product of a sum) to BF16, unlike the kernels.
    with autocast_off(a_MK.device):
        for start, end, g in zip(starts, ends, groups, strict=True):
            if g < b_GNK.shape[0] and end > start:
                out[start:end] = a_MK[start:end] @ b_GNK[g].T
    return out.to(out_dtype)


def _check_pair(a, b, a2, b2, tiles) -> None:
    _check_grouped(a, b, tiles)
    _check_grouped(a2, b2, tiles)
    if b.data.shape[:2] != b2.data.shape[:2] or a.scale.dtype != a2.scale.dtype:
        raise ValueError(
            f"B data shapes ({tuple(b.data.shape)}, {tuple(b2.data.shape)}) must agree in "
            "[G, N] and both pairs must use one scale format; pair the same layer's operands"
        )


def fp8_grouped_gemm_sum(
    a: Fp8Quantized,
    b: Fp8Quantized,
    a2: Fp8Quantized,
    b2: Fp8Quantized,
    tiles: RowTiles,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> Tensor:
    """``y[rows of g] = A[rows of g] @ B[g]ᵀ + A2[rows of g] @ B2[g]ᵀ`` in one pass.

    The input gradient of two projections that read the same input (an expert's gate and
    up projections): one kernel accumulates both products in fp32 and writes ``y`` once,
    instead of two GEMMs, two rounded outputs and an addition.

    Args:
        a: 1×128-quantized rows [M, K] (for dgrad: the gate output's gradient).
        b: 128×128-quantized stacked weights [G, N, K] (for dgrad: the gate weight's
            quantized transpose).
        a2: Second rows [M, K2].
        b2: Second weights [G, N, K2].
        tiles: Row tiles of the G groups.
        out_dtype: Output dtype.
        backend: Backend override (see module docstring).

    Returns:
        ``y`` [M, N] in ``out_dtype``.
    """
    _check_pair(a, b, a2, b2, tiles)
    if fp8_backend(a.data.device, backend) == "emulation":
        return fp8_grouped_gemm_sum_reference(a, b, a2, b2, tiles, out_dtype=out_dtype)
    return _grouped_gemm_triton(a, b, tiles, out_dtype, second=(a2, b2))


def fp8_grouped_gemm_sum_reference(
    a: Fp8Quantized,
    b: Fp8Quantized,
    a2: Fp8Quantized,
    b2: Fp8Quantized,
    tiles: RowTiles,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> Tensor:
    """Exact emulation of :func:`fp8_grouped_gemm_sum` (fp32 sum, one final rounding)."""
    del backend
    _check_pair(a, b, a2, b2, tiles)
    first = fp8_grouped_gemm_reference(a, b, tiles, out_dtype=torch.float32)
    second = fp8_grouped_gemm_reference(a2, b2, tiles, out_dtype=torch.float32)
    return (first + second).to(out_dtype)


# --- grouped wgrad: dW[g] = Σ over g's tiles of Aᵀ-tile · Bᵀ-tileᵀ --------------------------
# Tile-padded operands hold zeros past each tile's rows, so the K loop needs no masks or
# per-tile lengths and pipelines like a plain GEMM; scales are tile-major ([T, N]) so each
# step loads two contiguous scale rows. H200 sweep (Qwen3 shapes, T = 16k, gate wgrad):
# 64×128 4 stages 464 TFLOP/s; 128×128 365 (3 or 4 stages); 128×256 180. With the earlier
# strided [N, T] scales 128×128 ran 229 and with per-tile length loads and masks 115.
# Re-swept after the changes above (888 us = 464 TFLOP/s): 64×128 at 4 warps 3 stages 982,
# 5 stages 1424; 128×128 1131; 64×256 1135; 128×64 901.
WGRAD_CONFIG = {
    "BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 4, "num_warps": 8, "MAX_IMPRECISE": None
}  # fmt: skip
# With TMA loads (CUDA): 128×64 tiles at 4 warps won the H200 sweep. TFLOP/s, Qwen3 gate and
# down wgrad, pointer 64×128 fp32 output -> TMA 128×64: fp32 output 461 -> 476 and 463 -> 486,
# BF16 output 550 and 550; DeepSeek-V2-Lite fp32 511 -> 544, 515 -> 555, BF16 600, 604.
# Tried and not kept (H200, 16k tokens): a rescaled accumulator, acc = dot(a, b, acc · s_prev/s)
# then · s_last (exact for power-of-two scales), which needs one register set instead of two
# and so fits 128×128 tiles at 4 warps: wgrad 1.18-1.19x (Qwen3 558 -> 660 TFLOP/s, DeepSeek
# 606 -> 723), but every K block then adds into the tensor cores' narrow accumulator, so the
# fp32 error against the emulation grew from 1.25e-4 to 5.3e-4 / 6.9e-4 and grows with the
# tokens per expert. For fprop it allowed 128×256 tiles, +7% over the same kernel at 128×128
# but still 0.85x ours (the [BLOCK_N] B-scale vector), with fp32 error 4.4e-4 to 9.5e-4.
WGRAD_TMA_CONFIG = {
    "BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 4, "num_warps": 4, "MAX_IMPRECISE": None
}  # fmt: skip


@triton.jit
def _fp8_grouped_wgrad_kernel(
    a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, c_ptr, group_first_tile_ptr,
    M_A, N_B,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, SCALE_E8M0: tl.constexpr,
    UPCAST: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    first = tl.load(group_first_tile_ptr + g)
    last = tl.load(group_first_tile_ptr + g + 1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M_A
    col_ok = cols < N_B
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Tile t of the operands is the contiguous [M_A, 128] (and [N_B, 128]) block at t.
    a_ptrs = a_ptr + (first.to(tl.int64) * M_A + rows64[:, None]) * BLOCK_K + ks[None, :]
    b_ptrs = b_ptr + (first.to(tl.int64) * N_B + cols64[:, None]) * BLOCK_K + ks[None, :]
    for t in range(first, last):
        if USE_TMA:  # the [T·M_A, 128] view; rows past M_A (the next tile's) feed only
            # output rows (columns) past M_A (N_B), which are not stored
            a = a_desc.load([t * M_A + pid_m * BLOCK_M, 0])
            b = b_desc.load([t * N_B + pid_n * BLOCK_N, 0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            a_ptrs += M_A * BLOCK_K
            b_ptrs += N_B * BLOCK_K
        sa = tl.load(sa_ptr + t * M_A + rows, mask=row_ok, other=0)  # scales are [T, M_A]
        sb = tl.load(sb_ptr + t * N_B + cols, mask=col_ok, other=0)
        if SCALE_E8M0:
            sa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            sb = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if UPCAST:
            partial = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        else:
            partial = tl.dot(a, tl.trans(b), max_num_imprecise_acc=MAX_IMPRECISE)
        acc += partial * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + (g.to(tl.int64) * M_A + rows64[:, None]) * N_B + cols[None, :]
    c_mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _check_wgrad(
    a_t: Fp8Quantized, b_t: Fp8Quantized, tiles: RowTiles, out: Tensor | None = None
) -> None:
    shapes = (tuple(a_t.data.shape), tuple(b_t.data.shape))
    if a_t.data.dim() != 3 or b_t.data.dim() != 3 or a_t.data.shape[2] != BLOCK or (
        b_t.data.shape[2] != BLOCK or a_t.data.shape[0] != b_t.data.shape[0]
    ):
        raise ValueError(
            f"transposed operands' data shapes {shapes} must be the tile-major [T, N, 128] "
            "and [T, K, 128] of quantize_1x128_dual's transposed halves"
        )
    if a_t.data.shape[0] != tiles.num_tiles:
        raise ValueError(
            f"transposed data holds {a_t.data.shape[0]} tiles but the row tiles have "
            f"{tiles.num_tiles}; quantize both operands with the same tiles"
        )
    _check_scale_formats(a_t, b_t)
    expected = (tiles.group_first_tile_G.numel() - 1, a_t.data.shape[1], b_t.data.shape[1])
    if out is not None and tuple(out.shape) != expected:
        # The kernel writes [G, N, K] through raw offsets: a smaller out is overrun.
        raise ValueError(
            f"out shape ({tuple(out.shape)}) must be [G, N, K] = {list(expected)}; pass the "
            "weight's fp32 main_grad of the stacked [E, out, in] layout"
        )


def fp8_grouped_wgrad(
    a_t: Fp8Quantized,
    b_t: Fp8Quantized,
    tiles: RowTiles,
    *,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> Tensor:
    """``dW[g] = A[rows of g]ᵀ @ B[rows of g]`` from tile-major transposed FP8 operands.

    Args:
        a_t: Transposed half of :func:`~mt_ops.fp8_quant.quantize_1x128_dual` of the output
            gradient: tile-major data [T, N, 128], scales [T, N].
        b_t: The same for the layer input: data [T, K, 128], scales [T, K].
        tiles: The row tiles both were quantized with (G groups).
        out: Optional fp32 [G, N, K] to accumulate into (a weight's ``main_grad``);
            ``out_dtype`` is then unused.
        out_dtype: Dtype of a new result (without ``out``): fp32, or the parameter's dtype
            (BF16 under FSDP2 mixed precision), rounded once from the fp32 accumulator;
            writing BF16 directly halves the largest store of the backward pass and spares
            a conversion pass.
        backend: Backend override (see module docstring).

    Returns:
        [G, N, K] in ``out_dtype`` (``out`` itself when given, with the product added).
    """
    _check_wgrad(a_t, b_t, tiles, out)
    if out is not None and out.dtype != torch.float32:
        raise ValueError(
            f"out ({out.dtype}) must be float32 to accumulate into; accumulate into an fp32 "
            "main_grad, or pass out=None with out_dtype for a new result"
        )
    num_groups = tiles.group_first_tile_G.numel() - 1
    choice = fp8_backend(a_t.data.device, backend)
    if choice == "emulation":
        result = fp8_grouped_wgrad_reference(a_t, b_t, tiles)
        if out is None:
            return result.to(out_dtype)
        return out.add_(result)
    n_dim, k_dim = a_t.data.shape[1], b_t.data.shape[1]
    accumulate = out is not None
    shape = (num_groups, n_dim, k_dim)
    # Whether the Hopper kernel takes it, decided before allocating a result that the
    # cuBLAS route would not use.
    if out is None:
        hopper = _hopper_takes_new(a_t, b_t, shape=shape, dtype=out_dtype)
    else:  # supported() bounds out's element count itself
        hopper = _use_hopper(a_t, b_t, out=out)
    if num_groups == 1 and choice == "torch" and not hopper:
        result = _wgrad_torch(a_t, b_t, out, out_dtype)
        if result is not None:
            return result
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=a_t.data.device)
    if hopper:
        return fp8_gemm_hopper.grouped_wgrad(a_t, b_t, tiles, out, accumulate)
    e8m0 = a_t.scale.dtype == torch.float8_e8m0fnu
    sa = a_t.scale.view(torch.uint8) if e8m0 else a_t.scale
    sb = b_t.scale.view(torch.uint8) if e8m0 else b_t.scale
    a_2d, b_2d = a_t.data.view(-1, BLOCK), b_t.data.view(-1, BLOCK)  # [T·N, 128], [T·K, 128]
    use_tma = _use_tma(a_2d, b_2d)
    cfg = WGRAD_TMA_CONFIG if use_tma else WGRAD_CONFIG
    a_desc = _descriptor(a_2d, cfg["BLOCK_M"]) if use_tma else None
    b_desc = _descriptor(b_2d, cfg["BLOCK_N"]) if use_tma else None
    launch(
        _fp8_grouped_wgrad_kernel,
        (cdiv(n_dim, cfg["BLOCK_M"]), cdiv(k_dim, cfg["BLOCK_N"]), num_groups),
        a_t.data, a_desc, sa, b_t.data, b_desc, sb, out, tiles.group_first_tile_G,
        n_dim, k_dim,
        ACCUMULATE=accumulate, USE_TMA=use_tma, SCALE_E8M0=e8m0, UPCAST=not a_t.data.is_cuda,
        MAX_IMPRECISE=cfg["MAX_IMPRECISE"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=BLOCK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def fp8_grouped_wgrad_reference(
    a_t: Fp8Quantized,
    b_t: Fp8Quantized,
    tiles: RowTiles,
    *,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> Tensor:
    """Exact emulation of :func:`fp8_grouped_wgrad`: dequantize, fp32 matmul per group."""
    del backend
    _check_wgrad(a_t, b_t, tiles, out)
    a_NM = dequantize_tiles_transposed(a_t, tiles, tiles.num_rows)
    b_KM = dequantize_tiles_transposed(b_t, tiles, tiles.num_rows)
    num_groups = tiles.group_first_tile_G.numel() - 1
    first = tiles.group_first_tile_G.tolist()
    starts, ends = tiles.start_T.tolist(), tiles.end_T.tolist()
    result = torch.zeros(num_groups, a_NM.shape[0], b_KM.shape[0], device=a_NM.device)
    with autocast_off(a_NM.device):  # fp32 under autocast too (fp8_grouped_gemm_reference)
        for g in range(num_groups):
            if first[g + 1] > first[g]:
                lo, hi = starts[first[g]], ends[first[g + 1] - 1]
                result[g] = a_NM[:, lo:hi] @ b_KM[:, lo:hi].T
    return result.to(out_dtype) if out is None else out.add_(result)
