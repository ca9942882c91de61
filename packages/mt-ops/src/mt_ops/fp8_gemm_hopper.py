"""Warp-specialized Hopper kernels for the grouped FP8 GEMMs, written in Gluon.

Legend as in :mod:`mt_ops.fp8_gemm`: M rows (tokens), N output features, K contraction dim,
G groups (experts), T row tiles. Same products and the same results, bit for bit, as the
Triton kernels there (checked on the H200 by ``test_gpu_kernel_paths_agree_bit_for_bit``):

- :func:`grouped_gemm` — fprop and dgrad, ``y[rows of g] = A[rows of g] @ B[g]ᵀ`` (plus a
  second pair ``A2 @ B2[g]ᵀ`` for the gate + up dgrad);
- :func:`grouped_wgrad` — ``dW[g] = Σ over g's token tiles of Aᵀ-tile · Bᵀ-tileᵀ``.

Why a second implementation: the Triton kernels' 128×128 output tiles load 32 KB of
operands per K step for 4.2 MFLOP. At their ~760 TFLOP/s that is ~6 TB/s from L2 into the
SMs, about what the H200's L2 delivers, so a bigger tile was the lever, and a plain Triton
kernel cannot hold one (the earlier attempts are noted in mt_ops.fp8_gemm).
These kernels compute 128×256 tiles (48 KB per K step for 8.4 MFLOP). A fp32 accumulator
of 128×256 plus the per-K-block partial product DeepSeek-V3's promotion needs does not fit
one warpgroup's registers, so each program runs three partitions:

- a loader warp issuing TMA loads of A [128, 128] and B [256, 128] (and, for wgrad, the
  K step's scale rows) into a 3-stage ring guarded by ``ready``/``empty`` mbarriers;
- two consumer warpgroups, one per 128-column half of the tile. Each keeps its [128, 128]
  fp32 accumulator as two [64, 128] halves and, per K block, runs a wgmma of 64 rows into
  a fresh partial, waits, and adds ``partial · scale_a · scale_b`` in fp32; then the
  other 64 rows. While one warpgroup promotes, the other's wgmma runs.

Programs are persistent (one per SM) and walk the tiles with the N blocks of a row tile
consecutive; each partition reads the next tile's metadata while the current one runs.
Whole 128-row output tiles of 16-bit outputs leave through asynchronous TMA stores;
partial tiles (a group's last rows, which must not touch the next group's) and fp32
outputs use masked stores.

H200, 16k tokens, against the Triton kernels in the same run (TFLOP/s): Qwen3-30B-A3B gate
fprop 763 -> 985-1034, down fprop 605 -> 893-947, gate + up dgrad 685 -> 968-1012;
DeepSeek-V2-Lite 767 -> 937, 738 -> 949-1008, 779 -> 992-1000 (skewed routing 1.22-1.54x);
wgrad with BF16 output 549 -> 724 (Qwen3 gate), 575 -> 734 (DeepSeek gate), 1.11-1.32x
over all shapes, fp32 output 1.16-1.40x.

Measured and not kept (same shapes): 4 stages without TMA stores (3 stages and the 64 KB
store staging fit, 4 do not) 0.80-1.00x of the kept config; wgrad scales loaded from
global memory by the consumers instead of arriving by TMA with the tiles, 0.73-0.95x; the
consumers loading each K step's scales just before its wgmma instead of one step ahead,
half the speed. A plain accumulation (no promotion; not the recipe) would add 20-30%.
Half-width tiles (2026-12-01): N = 1408 (DeepSeek-V2-Lite's expert width) ends in a tile
whose second 128 columns lie past N, so its products and half its B loads are wasted, 1/12
of the gate and up fprop, down dgrad and down wgrad. Giving such tiles to both warpgroups
by rows (one wgmma per K step each) and loading B's first 128 rows only left every one of
those GEMMs as slow as before (512-517 us against 517-521 for gate fprop in the MLP step):
a tile's time does not follow its products or its bytes here. Loading each K step's
scales two steps ahead instead of one: 1-3.5% faster GEMMs in one run, the whole MLP step
unchanged (6.92 against 7.00 ms), within the run-to-run spread. Four stages for 16-bit
outputs (one [64, 128] store buffer per warpgroup, its halves stored in turn; 224 KB):
single GEMMs 2-3% faster, the gate + up dgrad sum and Qwen3's down fprop 2-3% slower, the
MLP step the same (DeepSeek-V2-Lite balanced 7.02 ms both ways). So neither the products,
the bytes, the scale loads' latency nor the loads in flight set a tile's time.
Wgrad's K step (2026-12-01): holding B's 128 column scales (32 per thread) through both
products made ptxas spill 8 accumulator registers (164 B), loaded and stored every step.
Reading the scales from the stage after each product compiles without spills (checked by
the sm_90 compile test); in source order the stage is released after the second promotion
instead of before it, behind the warpgroup barrier Triton puts before every arrive (now
written out), but ptxas moves most of that promotion's FMAs past the release anyway.
DeepSeek-V2-Lite's three wgrads in the MLP step: 661, 660, 721 us against 745, 743, 813 in
the same run (step 6.70 against 6.97 ms). The accumulating variant (fp32 added into a
gradient) keeps the old step: the new one spilled 1040 B there and its sums were wrong on
the H200 (2-4e-3 relative error against emulation). That build had the same barrier before
its arrive, so the cause is not a refilled stage; not investigated further. Releasing the
stage in source before the second promotion compiles to the same SASS (a review's check).
SwiGLU's backward in the down projection's dgrad epilogue (2026-12-01, branch
swiglu-bwd-epilogue, bit-exact against the GEMM into dh and mt_ops.swiglu's backward): each
warpgroup loaded gate and up and stored both gradients straight from the MMA layout, so dh
never went to memory. The dgrad took 1729-1963 us against 507 + 320 for the GEMM and the
SwiGLU kernel (DeepSeek-V2-Lite), 1217-1373 against 357 + 232 (Qwen3): 4-byte accesses
that use half of each sector, done while the tensor cores wait, and 476-1788 B of spills
per thread through an L1 of ~29 KB beside 208 KB of shared memory, cost far more than the
separate pass at full bandwidth. Staged through the 16-bit store buffers instead (TMA loads
of gate and up, 64 rows at a time, the first 64 while the K loop runs; TMA stores of the
gradients; bit-exact, no spills in the K loop): 1358 us against 511 + 320, the MLP step
6.93 against 6.72 ms (Qwen3: 933 against 360 + 232, 5.54 against 5.39). Every SM loads
and stores its tile's 256 KB at the same point of its tile, in bursts, while its tensor
cores wait; the separate pass streams the same bytes at full bandwidth.
What bounds these kernels (2026-12-01, H200, DeepSeek-V2-Lite shapes, balanced): the
operands' trip from L2. With either operand's TMA load left out of every K step (the same
products on stale shared memory), the down projection's fprop took 456 us (B left out) or
453 (A left out) against 597, 1250 against 950 TFLOP/s; the gate wgrad 568 / 565 against
667. At the kept rate a program's K step brings 48 KB for 8.4 MFLOP, ~5.4 TB/s from L2
over the GPU; dropping 16 or 32 KB of it gives the same ~1250 TFLOP/s, the products and
promotions' own rate at the power-capped clocks. The lever is TMA multicast across a
cluster of two programs sharing an operand (each loads half of it for both), which
halves that operand's L2 reads; Triton 3.6's Gluon exposes no multicast TMA load (its
lowering reports "NYI: Support multicast").
Wgrad's column scales (B's, 32 per thread) are what separates it from fprop: the gate
wgrad took 559 us with A's row scales only and 525 with none, against 667 (wrong results,
timing only); 605 with a second multiply but no column-scale loads, 609 with the loads and
one multiply. Measured and not kept, all bit-exact: the column scales loaded while the
first product runs and held through both (240 registers per consumer, 24 for the loader,
no spills) 688 us; that and the stage released before the second promotion 691;
double-buffered [64, 64] products so that a warpgroup promotes one while the next runs
737; the two warpgroups' products put in turn by an mbarrier pair, each issued once the
other's was issued 691, once the other's had finished 766.
E8M0 scales take the Triton kernels: a build of these kernels reading E8M0 exponents
stopped the H200 with an illegal instruction, not investigated for lack of device time.

Gluon pitfalls met on Triton 3.6 (kept here so nobody meets them again): constexpr values
packed into a tuple passed to ``gl.warp_specialize`` arrive as runtime tensors (flags are
passed as separate constexpr arguments); a K loop whose bounds are carried from the
previous tile miscompiled (wrong results from the second tile of a program on), so the
wgrad partitions load a tile's bounds at its start; a runtime ``if`` yielding tensors
loaded in a slice of the MMA layout, or a TMA store outside a runtime ``if`` with an
``else``, hit a lowering assertion.
"""

from functools import cache

import torch
from torch import Tensor

from mt_ops._triton import num_sms, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton: the Triton kernels run instead
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "grouped_gemm", "grouped_wgrad", "supported"]

_BLOCK = 128  # rows of A per tile, K per step, columns per consumer warpgroup
_BLOCK_N = 2 * _BLOCK  # output columns of a program
_STAGES = 3
# Registers per thread of the consumer warpgroups and of the loader warp's warpgroup
# (setmaxnreg; 2 x 232 + 40 fits the register file with 128 threads each).
_CONSUMER_REGS, _LOADER_REGS = 232, 40
if HAS_GLUON:  # kernels read these as compile-time constants
    BLOCK = gl.constexpr(_BLOCK)
    BLOCK_N = gl.constexpr(_BLOCK_N)
    STAGES = gl.constexpr(_STAGES)
    CONSUMER_REGS = gl.constexpr(_CONSUMER_REGS)
    LOADER_REGS = gl.constexpr(_LOADER_REGS)
    # A consumer warpgroup's wgmma results: [64, 128] fp32 over its 4 warps.
    MMA_LAYOUT = gl.constexpr(
        gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    )


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once (``supported`` runs on every GEMM)."""
    return torch.cuda.get_device_capability(device)


def supported(operands, out: Tensor) -> bool:
    """Whether these kernels can run ``operands`` (:class:`~mt_ops.fp8_quant.Fp8Quantized`)
    into ``out``: Gluon imports, the device is a Hopper GPU (sm_90: wgmma), the scales are
    contiguous fp32 (E8M0 scales take the Triton kernels), ``out`` is BF16, FP16 or fp32,
    and the data and ``out`` are contiguous, 16-byte aligned CUDA tensors with 16-byte
    aligned rows, non-empty, with fewer than 2³¹ elements (TMA coordinates and row offsets
    are int32)."""
    # Not mt_ops.fp8_gemm._use_tma, which differs twice: it bounds rows (here: elements) by
    # 2³¹ and wants rows of a multiple of 16 elements (``out`` here: of 16 bytes).
    if not HAS_GLUON or not out.is_cuda or _capability(out.device) != (9, 0):
        return False
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    tensors = [q.data for q in operands] + [out]
    return all(
        q.scale.is_contiguous() and q.scale.dtype == torch.float32 for q in operands
    ) and all(
        t.is_cuda
        and t.is_contiguous()
        and t.numel() > 0
        and t.data_ptr() % 16 == 0
        and (t.shape[-1] * t.element_size()) % 16 == 0
        and t.numel() < 2**31
        for t in tensors
    )


if HAS_GLUON:

    @gluon.jit
    def _load_scale(ptr, offs, mask):
        """fp32 scales (0 where masked)."""
        return gl.load(ptr + offs, mask=mask, other=0)

    @gluon.jit
    def _tile_meta(tile_start_ptr, tile_end_ptr, tile_group_ptr, pid, num_n_blocks, total,
                   num_groups):  # fmt: skip
        """Group, first and end row of output tile ``pid`` (group G past the last tile)."""
        pid_t = pid // num_n_blocks
        ok = pid < total
        g = gl.load(tile_group_ptr + pid_t, mask=ok, other=num_groups)
        row_start = gl.load(tile_start_ptr + pid_t, mask=ok, other=0)
        row_end = gl.load(tile_end_ptr + pid_t, mask=ok, other=0)
        return g, row_start, row_end

    @gluon.jit
    def _ring(desc):
        """Shared memory for STAGES tiles of ``desc``'s block."""
        return gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def _stage_barriers():
        """The ring's ``ready`` (TMA bytes landed) and ``empty`` (both consumer warpgroups
        done with the stage) mbarriers."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return ready, empty

    @gluon.jit
    def _claim_free_stage(ready, empty, i, nbytes: gl.constexpr):
        """The loader's ``i``-th stage (``i % STAGES``) and its ``ready`` barrier, once the
        consumers have released the stage's previous round; the barrier then expects
        ``nbytes`` of TMA loads."""
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        return s, ready.index(s)

    @gluon.jit
    def _load_ab(a_desc, b_desc, a_row, b_row, k, bar, a_bufs, b_bufs, s):
        """TMA loads of A's [128, 128] tile at (a_row, k) and B's [256, 128] tile at
        (b_row, k) into stage ``s`` of the rings, completing on ``bar``."""
        tma.async_copy_global_to_shared(a_desc, [a_row, k], bar, a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_bufs.index(s))

    @gluon.jit
    def _store_staging(c_desc, TMA_STORE: gl.constexpr):
        """Staging for the TMA stores: two [64, 128] halves per consumer warpgroup."""
        NUM_C: gl.constexpr = 4 if TMA_STORE else 1
        return gl.allocate_shared_memory(c_desc.dtype, [NUM_C] + c_desc.block_type.shape,
                                         c_desc.layout)  # fmt: skip

    @gluon.jit
    def _tma_store_halves(c_desc, c_bufs, acc0, acc1, row, col, CID: gl.constexpr):
        """Writes a warpgroup's [128, 128] block (``acc0`` over ``acc1``) at (row, col) with
        asynchronous TMA stores, once the previous ones have read the staging buffers."""
        tma.store_wait(0)
        gl.thread_barrier()
        c_bufs.index(2 * CID).store(acc0.to(c_desc.dtype))
        c_bufs.index(2 * CID + 1).store(acc1.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [row, col], c_bufs.index(2 * CID))
        tma.async_copy_shared_to_global(c_desc, [row + 64, col], c_bufs.index(2 * CID + 1))

    @gluon.jit
    def _tma_store_halves_transposed(c_desc, c_bufs, acc0, acc1, row, col, CID: gl.constexpr):
        """Writes the transpose of a warpgroup's [128, 128] block (``acc0`` over ``acc1``) at
        (row, col): ``c_desc``'s [128, 64] blocks take ``acc0ᵀ`` and, 64 columns on, ``acc1ᵀ``."""
        tma.store_wait(0)
        gl.thread_barrier()
        c_bufs.index(2 * CID).permute((1, 0)).store(acc0.to(c_desc.dtype))
        c_bufs.index(2 * CID + 1).permute((1, 0)).store(acc1.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [row, col], c_bufs.index(2 * CID))
        tma.async_copy_shared_to_global(c_desc, [row, col + 64], c_bufs.index(2 * CID + 1))

    # --- fprop / dgrad ----------------------------------------------------------------------

    @gluon.jit
    def _gemm_loader(p, HAS_SECOND: gl.constexpr, PAIRED: gl.constexpr):
        (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
         sa2_ptr, sb2_ptr, c_ptr, c_desc, c_bufs, tile_start_ptr, tile_end_ptr, tile_group_ptr,
         N, num_k1, num_k2, num_n_scale, num_n_blocks, num_tiles, num_groups,
         num_programs, c2_ptr, c2_desc) = p  # fmt: skip
        # PAIRED: B's [256, 128] stage holds 128 rows of each weight ([128, 128] blocks).
        B_LOADS: gl.constexpr = 2 if PAIRED else 1
        nbytes: gl.constexpr = a_desc.block_type.nbytes + B_LOADS * b_desc.block_type.nbytes
        total = num_tiles * num_n_blocks
        i = 0
        g, row_start, _ = _tile_meta(tile_start_ptr, tile_end_ptr, tile_group_ptr,
                                     gl.program_id(0), num_n_blocks, total, num_groups)  # fmt: skip
        for pid in range(gl.program_id(0), total, num_programs):
            pid_n = pid % num_n_blocks
            g_next, start_next, _ = _tile_meta(
                tile_start_ptr, tile_end_ptr, tile_group_ptr, pid + num_programs,
                num_n_blocks, total, num_groups,
            )  # fmt: skip
            if PAIRED and g < num_groups:  # the same 128 rows of both weights
                b_row = g * N + pid_n * BLOCK
                for kb in range(num_k1):
                    s, bar = _claim_free_stage(ready, empty, i, nbytes)
                    stage = b_bufs.index(s)
                    tma.async_copy_global_to_shared(a_desc, [row_start, kb * BLOCK], bar,
                                                    a_bufs.index(s))  # fmt: skip
                    tma.async_copy_global_to_shared(b_desc, [b_row, kb * BLOCK], bar,
                                                    stage.slice(0, BLOCK))  # fmt: skip
                    tma.async_copy_global_to_shared(b2_desc, [b_row, kb * BLOCK], bar,
                                                    stage.slice(BLOCK, BLOCK))  # fmt: skip
                    i += 1
            elif g < num_groups:  # tile slots past the last group are unused
                b_row = g * N + pid_n * BLOCK_N  # B viewed as [G·N, K]
                for kb in range(num_k1 + num_k2):
                    s, bar = _claim_free_stage(ready, empty, i, nbytes)
                    if HAS_SECOND and kb >= num_k1:
                        _load_ab(a2_desc, b2_desc, row_start, b_row, (kb - num_k1) * BLOCK, bar,
                                 a_bufs, b_bufs, s)  # fmt: skip
                    else:
                        _load_ab(a_desc, b_desc, row_start, b_row, kb * BLOCK, bar, a_bufs, b_bufs,
                                 s)  # fmt: skip
                    i += 1
            g, row_start = g_next, start_next

    @gluon.jit
    def _step_scales(sa_ptr, sb_ptr, sa2_ptr, sb2_ptr, rows, ok0, ok1, sb_row, sb_ok, kb, valid,
                     num_k1, num_k2, HAS_SECOND: gl.constexpr):  # fmt: skip
        """Scales of K step ``kb``: both 64-row halves of A's and the B block's."""
        sa_p = sa_ptr
        sb_p = sb_ptr
        num_k = num_k1
        k = kb
        if HAS_SECOND and kb >= num_k1:
            sa_p = sa2_ptr
            sb_p = sb2_ptr
            num_k = num_k2
            k = kb - num_k1
        offs = rows.to(gl.int64) * num_k + k
        sa0 = _load_scale(sa_p, offs, ok0 & valid)
        sa1 = _load_scale(sa_p, offs + 64 * num_k, ok1 & valid)
        sb = _load_scale(sb_p, sb_row * num_k + k, sb_ok & valid)
        return sa0, sa1, sb

    @gluon.jit
    def _gemm_consumer(p, CID: gl.constexpr, HAS_SECOND: gl.constexpr,
                       TMA_STORE: gl.constexpr, PAIRED: gl.constexpr):  # fmt: skip
        (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
         sa2_ptr, sb2_ptr, c_ptr, c_desc, c_bufs, tile_start_ptr, tile_end_ptr, tile_group_ptr,
         N, num_k1, num_k2, num_n_scale, num_n_blocks, num_tiles, num_groups,
         num_programs, c2_ptr, c2_desc) = p  # fmt: skip
        mma: gl.constexpr = MMA_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        part = gl.zeros([64, BLOCK], gl.float32, mma)
        total = num_tiles * num_n_blocks
        num_steps = num_k1 + num_k2
        i = 0
        g, row_start, row_end = _tile_meta(
            tile_start_ptr, tile_end_ptr, tile_group_ptr, gl.program_id(0), num_n_blocks, total,
            num_groups,
        )  # fmt: skip
        for pid in range(gl.program_id(0), total, num_programs):
            pid_n = pid % num_n_blocks
            g_next, start_next, end_next = _tile_meta(
                tile_start_ptr, tile_end_ptr, tile_group_ptr, pid + num_programs,
                num_n_blocks, total, num_groups,
            )  # fmt: skip
            if g < num_groups:
                # This warpgroup's 128 columns: one B scale block (PAIRED: of its own weight,
                # the same columns as the other warpgroup's).
                n_block = pid_n if PAIRED else pid_n * 2 + CID
                sb_row = g * num_n_scale + n_block
                sb_ok = n_block < num_n_scale
                rows = row_start + gl.arange(0, 64, layout=row_l)
                ok0 = rows < row_end
                ok1 = rows + 64 < row_end
                acc0 = gl.zeros([64, BLOCK], gl.float32, mma)
                acc1 = gl.zeros([64, BLOCK], gl.float32, mma)
                sb_p = sb_ptr
                if PAIRED and CID == 1:
                    sb_p = sb2_ptr
                sa0_next, sa1_next, sb_next = _step_scales(
                    sa_ptr, sb_p, sa2_ptr, sb2_ptr, rows, ok0, ok1, sb_row, sb_ok, 0, True,
                    num_k1, num_k2, HAS_SECOND,
                )  # fmt: skip
                for kb in range(num_steps):
                    s = i % STAGES
                    sa0, sa1, sb = sa0_next, sa1_next, sb_next
                    # The next step's scales load while this step's products run.
                    sa0_next, sa1_next, sb_next = _step_scales(
                        sa_ptr, sb_p, sa2_ptr, sb2_ptr, rows, ok0, ok1, sb_row, sb_ok, kb + 1,
                        kb + 1 < num_steps, num_k1, num_k2, HAS_SECOND,
                    )  # fmt: skip
                    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                    a_s = a_bufs.index(s)
                    b_s = b_bufs.index(s).slice(CID * BLOCK, BLOCK).permute((1, 0))
                    part = warpgroup_mma(a_s.slice(0, 64), b_s, part, use_acc=False, is_async=True)
                    part = warpgroup_mma_wait(0, deps=(part,))
                    acc0 += part * (sa0 * sb)[:, None]
                    part = warpgroup_mma(a_s.slice(64, 64), b_s, part, use_acc=False, is_async=True)
                    part = warpgroup_mma_wait(0, deps=(part,))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc1 += part * (sa1 * sb)[:, None]
                    i += 1
                col0 = pid_n * BLOCK_N + CID * BLOCK
                out_desc = c_desc
                out_ptr = c_ptr
                if PAIRED:  # warpgroup 1 writes the second weight's product
                    col0 = pid_n * BLOCK
                    if CID == 1:
                        out_desc = c2_desc
                        out_ptr = c2_ptr
                if TMA_STORE and row_end - row_start == BLOCK:
                    # A whole tile: asynchronous stores that overlap the next tile's loop
                    # (columns past N are clipped), once the last ones have read the buffers.
                    _tma_store_halves(out_desc, c_bufs, acc0, acc1, row_start, col0, CID)
                else:  # masked: a group's last rows must not touch the next group's
                    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                    cols = col0 + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, out_l))
                    col_ok = cols < N
                    out_rows = row_start + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
                    c0 = out_ptr + out_rows.to(gl.int64)[:, None] * N + cols[None, :]
                    gl.store(c0, gl.convert_layout(acc0.to(out_ptr.dtype.element_ty), out_l),
                             mask=(out_rows < row_end)[:, None] & col_ok[None, :])  # fmt: skip
                    gl.store(c0 + 64 * N,
                             gl.convert_layout(acc1.to(out_ptr.dtype.element_ty), out_l),
                             mask=(out_rows + 64 < row_end)[:, None] & col_ok[None, :])  # fmt: skip
            g, row_start, row_end = g_next, start_next, end_next
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_kernel(
        a_desc, b_desc, a2_desc, b2_desc, c_desc, sa_ptr, sb_ptr, sa2_ptr, sb2_ptr, c_ptr,
        tile_start_ptr, tile_end_ptr, tile_group_ptr,
        N, num_k1, num_k2, num_n_scale, num_n_blocks, num_tiles, num_groups, num_programs,
        c2_ptr, c2_desc,
        HAS_SECOND: gl.constexpr, TMA_STORE: gl.constexpr, PAIRED: gl.constexpr,
    ):  # fmt: skip
        a_bufs = _ring(a_desc)
        # [STAGES, 256, 128] whether B's block is [256, 128] or (PAIRED) two [128, 128]
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK], b_desc.layout)
        c_bufs = _store_staging(c_desc, TMA_STORE)
        ready, empty = _stage_barriers()
        p = (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr,
             sa2_ptr, sb2_ptr, c_ptr, c_desc, c_bufs, tile_start_ptr, tile_end_ptr,
             tile_group_ptr, N, num_k1, num_k2, num_n_scale, num_n_blocks, num_tiles,
             num_groups, num_programs, c2_ptr, c2_desc)  # fmt: skip
        gl.warp_specialize(
            [
                (_gemm_consumer, (p, 0, HAS_SECOND, TMA_STORE, PAIRED)),
                (_gemm_consumer, (p, 1, HAS_SECOND, TMA_STORE, PAIRED)),
                (_gemm_loader, (p, HAS_SECOND, PAIRED)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )

    # --- wgrad ------------------------------------------------------------------------------

    @gluon.jit
    def _wgrad_bounds(group_first_ptr, pid, num_m, num_n):
        """Group of output tile ``pid`` and its first and end token tile."""
        g = pid // (num_m * num_n)
        return g, gl.load(group_first_ptr + g), gl.load(group_first_ptr + g + 1)

    @gluon.jit
    def _wgrad_loader(p):
        (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
         c_ptr, c_desc, c_bufs, group_first_ptr, N, K, num_m, num_n, num_groups,
         num_programs) = p  # fmt: skip
        nbytes: gl.constexpr = (
            a_desc.block_type.nbytes + b_desc.block_type.nbytes
            + sa_desc.block_type.nbytes + sb_desc.block_type.nbytes
        )  # fmt: skip
        i = 0
        for pid in range(gl.program_id(0), num_groups * num_m * num_n, num_programs):
            pid_n = pid % num_n
            pid_m = (pid // num_n) % num_m
            g, first, last = _wgrad_bounds(group_first_ptr, pid, num_m, num_n)
            for t in range(first, last):
                s, bar = _claim_free_stage(ready, empty, i, nbytes)
                # Tile t of the tile-major operands: rows t·N ... of [T·N, 128] (and of
                # [T·K, 128]); rows past N (K) belong to the next tile and feed only
                # output rows (columns) that are not stored.
                _load_ab(a_desc, b_desc, t * N + pid_m * BLOCK, t * K + pid_n * BLOCK_N, 0, bar,
                         a_bufs, b_bufs, s)  # fmt: skip
                # The step's scales: rows of the tile-major [T, N] and [T, K], read flat.
                tma.async_copy_global_to_shared(sa_desc, [t * N + pid_m * BLOCK], bar,
                                                sa_bufs.index(s))  # fmt: skip
                tma.async_copy_global_to_shared(sb_desc, [t * K + pid_n * BLOCK_N], bar,
                                                sb_bufs.index(s))  # fmt: skip
                i += 1

    @gluon.jit
    def _wgrad_consumer(p, CID: gl.constexpr, TMA_STORE: gl.constexpr,
                        ACCUMULATE: gl.constexpr, TRANSPOSED: gl.constexpr):  # fmt: skip
        gl.static_assert(not TRANSPOSED or (TMA_STORE and not ACCUMULATE))
        (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
         c_ptr, c_desc, c_bufs, group_first_ptr, N, K, num_m, num_n, num_groups,
         num_programs) = p  # fmt: skip
        mma: gl.constexpr = MMA_LAYOUT
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        part = gl.zeros([64, BLOCK], gl.float32, mma)
        i = 0
        for pid in range(gl.program_id(0), num_groups * num_m * num_n, num_programs):
            pid_n = pid % num_n
            pid_m = (pid // num_n) % num_m
            g, first, last = _wgrad_bounds(group_first_ptr, pid, num_m, num_n)
            acc0 = gl.zeros([64, BLOCK], gl.float32, mma)
            acc1 = gl.zeros([64, BLOCK], gl.float32, mma)
            # The K step is written out here rather than shared with _gemm_consumer's: a
            # shared helper's inlined line-info labels once changed ptxas's schedule and
            # spills in this loop, which only the H200 can judge.
            for _ in range(first, last):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                a_s = a_bufs.index(s)
                b_s = b_bufs.index(s).slice(CID * BLOCK, BLOCK).permute((1, 0))
                sb_s = sb_bufs.index(s).slice(CID * BLOCK, BLOCK)
                if ACCUMULATE:  # the scales held through both products (see the docstring)
                    sa0 = sa_bufs.index(s).slice(0, 64).load(row_l)
                    sa1 = sa_bufs.index(s).slice(64, 64).load(row_l)
                    sb = sb_s.load(col_l)
                    part = warpgroup_mma(a_s.slice(0, 64), b_s, part, use_acc=False,
                                         is_async=True)  # fmt: skip
                    part = warpgroup_mma_wait(0, deps=(part,))
                    acc0 += part * sa0[:, None] * sb[None, :]
                    part = warpgroup_mma(a_s.slice(64, 64), b_s, part, use_acc=False,
                                         is_async=True)  # fmt: skip
                    part = warpgroup_mma_wait(0, deps=(part,))
                    gl.thread_barrier()  # as below (Triton emits it here anyway)
                    mbarrier.arrive(empty.index(s), count=1)
                    acc1 += part * sa1[:, None] * sb[None, :]
                else:  # the scales read from the stage after each product
                    part = warpgroup_mma(a_s.slice(0, 64), b_s, part, use_acc=False,
                                         is_async=True)  # fmt: skip
                    part = warpgroup_mma_wait(0, deps=(part,))
                    sa0 = sa_bufs.index(s).slice(0, 64).load(row_l)
                    acc0 += part * sa0[:, None] * sb_s.load(col_l)[None, :]
                    part = warpgroup_mma(a_s.slice(64, 64), b_s, part, use_acc=False,
                                         is_async=True)  # fmt: skip
                    part = warpgroup_mma_wait(0, deps=(part,))
                    sa1 = sa_bufs.index(s).slice(64, 64).load(row_l)
                    acc1 += part * sa1[:, None] * sb_s.load(col_l)[None, :]
                    # One thread arrives for the warpgroup: its four warps must all have
                    # read the stage before the loader may refill it. Triton's shared-memory
                    # barrier pass already puts this warpgroup barrier before every arrive;
                    # written out, it no longer rests on that pass.
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s), count=1)
                i += 1
            col0 = pid_n * BLOCK_N + CID * BLOCK
            if TRANSPOSED:  # c [G, K, N] viewed as [G·K, N]; K % 128 == 0, N % 128 == 0
                if col0 < K:  # a last 256-column tile may end at K + 128
                    _tma_store_halves_transposed(c_desc, c_bufs, acc0, acc1, g * K + col0,
                                                 pid_m * BLOCK, CID)  # fmt: skip
            elif TMA_STORE and last >= first:  # (always true: see the module docstring)
                # Whole 128-row tiles (N % 128 == 0); columns past K are clipped.
                c_row = g * N + pid_m * BLOCK  # c viewed as [G·N, K]
                _tma_store_halves(c_desc, c_bufs, acc0, acc1, c_row, col0, CID)
            else:  # masked stores straight from the MMA layout
                cols = col0 + gl.arange(0, BLOCK, layout=col_l)
                rows = pid_m * BLOCK + gl.arange(0, 64, layout=row_l)
                c0 = c_ptr + (g.to(gl.int64) * N + rows)[:, None] * K + cols[None, :]
                mask0 = (rows < N)[:, None] & (cols < K)[None, :]
                mask1 = (rows + 64 < N)[:, None] & (cols < K)[None, :]
                if ACCUMULATE:
                    acc0 += gl.load(c0, mask=mask0, other=0.0)
                    acc1 += gl.load(c0 + 64 * K, mask=mask1, other=0.0)
                gl.store(c0, acc0.to(c_ptr.dtype.element_ty), mask=mask0)
                gl.store(c0 + 64 * K, acc1.to(c_ptr.dtype.element_ty), mask=mask1)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _grouped_wgrad_kernel(
        a_desc, b_desc, sa_desc, sb_desc, c_desc, c_ptr, group_first_ptr,
        N, K, num_m, num_n, num_groups, num_programs,
        TMA_STORE: gl.constexpr, ACCUMULATE: gl.constexpr, TRANSPOSED: gl.constexpr,
    ):  # fmt: skip
        a_bufs = _ring(a_desc)
        b_bufs = _ring(b_desc)
        sa_bufs = _ring(sa_desc)
        sb_bufs = _ring(sb_desc)
        c_bufs = _store_staging(c_desc, TMA_STORE)
        ready, empty = _stage_barriers()
        p = (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
             c_ptr, c_desc, c_bufs, group_first_ptr, N, K, num_m, num_n, num_groups,
             num_programs)  # fmt: skip
        gl.warp_specialize(
            [
                (_wgrad_consumer, (p, 0, TMA_STORE, ACCUMULATE, TRANSPOSED)),
                (_wgrad_consumer, (p, 1, TMA_STORE, ACCUMULATE, TRANSPOSED)),
                (_wgrad_loader, (p,)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


def _launch(kernel, grid, *args, **kwargs):
    """Launches a Gluon kernel (a seam: the CPU test compiles through it instead)."""
    return kernel[grid](*args, **kwargs)


def _fp8_descriptor(data: Tensor, block_rows: int):
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, _BLOCK], gl.float8e4nv)
    return GluonDescriptor.from_tensor(data, [block_rows, _BLOCK], layout)


def _out_descriptor(out_2d: Tensor, block=(64, _BLOCK)):
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[
        out_2d.dtype
    ]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    return GluonDescriptor.from_tensor(out_2d, list(block), layout)


def grouped_gemm(a, b, tiles, out: Tensor, second=None) -> Tensor:
    """Writes ``out`` [M, N] = A @ B[g]ᵀ per row tile (+ A2 @ B2[g]ᵀ); operands as in
    :func:`mt_ops.fp8_gemm.fp8_grouped_gemm`. The caller checks :func:`supported`."""
    num_rows, k_dim = a.data.shape
    num_groups, n_dim, _ = b.data.shape
    a2, b2 = second if second is not None else (a, b)
    k2_dim = a2.data.shape[1]
    num_n_blocks = triton.cdiv(n_dim, _BLOCK_N)
    total = tiles.num_tiles * num_n_blocks
    num_programs = max(1, min(total, num_sms(a.data.device)))
    # Whole row tiles of a 16-bit output leave through TMA stores (fp32 would need 128 KB
    # of staging next to the 144 KB operand ring).
    tma_store = out.element_size() == 2
    _launch(
        _grouped_gemm_kernel, (num_programs,),
        _fp8_descriptor(a.data, _BLOCK), _fp8_descriptor(b.data.view(-1, k_dim), _BLOCK_N),
        _fp8_descriptor(a2.data, _BLOCK), _fp8_descriptor(b2.data.view(-1, k2_dim), _BLOCK_N),
        _out_descriptor(out), a.scale, b.scale, a2.scale, b2.scale, out,
        tiles.start_T, tiles.end_T, tiles.group_T,
        n_dim, triton.cdiv(k_dim, _BLOCK), triton.cdiv(k2_dim, _BLOCK) if second else 0,
        triton.cdiv(n_dim, _BLOCK), num_n_blocks, tiles.num_tiles, num_groups, num_programs,
        out, _out_descriptor(out),
        HAS_SECOND=second is not None, TMA_STORE=tma_store, PAIRED=False, num_warps=4,
    )  # fmt: skip
    return out


def grouped_gemm_pair(a, b, b2, tiles, out: Tensor, out2: Tensor) -> tuple[Tensor, Tensor]:
    """Writes ``out`` = A @ B[g]ᵀ and ``out2`` = A @ B2[g]ᵀ per row tile (a layer's gate and
    up projections of the same rows) in one kernel: each program computes the same 128
    columns of both, one per consumer warpgroup, reading A once. Same bits as two
    :func:`grouped_gemm` calls. The caller checks :func:`supported` for both products."""
    num_rows, k_dim = a.data.shape
    num_groups, n_dim, _ = b.data.shape
    num_n_blocks = triton.cdiv(n_dim, _BLOCK)
    total = tiles.num_tiles * num_n_blocks
    num_programs = max(1, min(total, num_sms(a.data.device)))
    tma_store = out.element_size() == 2
    b_desc = _fp8_descriptor(b.data.view(-1, k_dim), _BLOCK)
    _launch(
        _grouped_gemm_kernel, (num_programs,),
        _fp8_descriptor(a.data, _BLOCK), b_desc,
        _fp8_descriptor(a.data, _BLOCK), _fp8_descriptor(b2.data.view(-1, k_dim), _BLOCK),
        _out_descriptor(out), a.scale, b.scale, a.scale, b2.scale, out,
        tiles.start_T, tiles.end_T, tiles.group_T,
        n_dim, triton.cdiv(k_dim, _BLOCK), 0,
        triton.cdiv(n_dim, _BLOCK), num_n_blocks, tiles.num_tiles, num_groups, num_programs,
        out2, _out_descriptor(out2),
        HAS_SECOND=False, TMA_STORE=tma_store, PAIRED=True, num_warps=4,
    )  # fmt: skip
    return out, out2


def _flat_scale_descriptor(scale: Tensor, block: int):
    flat = scale.reshape(-1)
    layout = gl.NVMMASharedLayout(0, 32, rank=1)
    return GluonDescriptor(flat, [flat.numel()], [1], [block], layout)


def grouped_wgrad(a_t, b_t, tiles, out: Tensor, accumulate: bool) -> Tensor:
    """Writes (or with ``accumulate`` adds to) ``out`` [G, N, K] = Σ tiles Aᵀ Bᵀᵀ; operands as
    in :func:`mt_ops.fp8_gemm.fp8_grouped_wgrad`. The caller checks :func:`supported`."""
    n_dim, k_dim = a_t.data.shape[1], b_t.data.shape[1]
    num_groups = tiles.group_first_tile_G.numel() - 1
    tma_store = not accumulate and out.element_size() == 2 and n_dim % _BLOCK == 0
    out_desc = None
    if tma_store and _transposed_tiles_fewer(n_dim, k_dim):
        # Compute outᵀ's tiles (A and B swapped) and store each one transposed.
        a_t, b_t, n_dim, k_dim = b_t, a_t, k_dim, n_dim
        out_desc = _out_descriptor(out.view(-1, n_dim), (_BLOCK, 64))
    num_m, num_n = triton.cdiv(n_dim, _BLOCK), triton.cdiv(k_dim, _BLOCK_N)
    total = num_groups * num_m * num_n
    num_programs = max(1, min(total, num_sms(a_t.data.device)))
    _launch(
        _grouped_wgrad_kernel, (num_programs,),
        _fp8_descriptor(a_t.data.view(-1, _BLOCK), _BLOCK),
        _fp8_descriptor(b_t.data.view(-1, _BLOCK), _BLOCK_N),
        _flat_scale_descriptor(a_t.scale, _BLOCK), _flat_scale_descriptor(b_t.scale, _BLOCK_N),
        out_desc or _out_descriptor(out.view(-1, k_dim)), out, tiles.group_first_tile_G,
        n_dim, k_dim, num_m, num_n, num_groups, num_programs,
        TMA_STORE=tma_store, ACCUMULATE=accumulate, TRANSPOSED=out_desc is not None,
        num_warps=4,
    )  # fmt: skip
    return out


# Wgrad of out [N, K] per group may compute outᵀ's tiles instead (A and B swapped, each tile
# stored transposed) when K is not a multiple of 256 but N is: DeepSeek-V2-Lite's down
# projection [2048, 1408] then takes 11 x 8 whole tiles per expert instead of 16 x 6 with
# the last 128 columns of every sixth tile past K. H200 (2026-12-01, MLP step profile,
# balanced): that wgrad 675 us against 715-732, the others unchanged (668 / 669); the step
# 6.55 against 6.61 ms (CUDA-graph replay 6.53 against 6.63). Bit-exact against the plain
# tiles (test_gpu_transposed_wgrad_tiles_equal_plain_tiles_bit_for_bit).
WGRAD = {"transposed": True}


def _transposed_tiles_fewer(n_dim: int, k_dim: int) -> bool:
    """Whether outᵀ [K, N] takes fewer 128 x 256 tiles than out [N, K] (both dimensions
    multiples of 128, which the transposed stores need)."""
    if not WGRAD["transposed"] or n_dim % _BLOCK or k_dim % _BLOCK:
        return False
    tiles = triton.cdiv(n_dim, _BLOCK) * triton.cdiv(k_dim, _BLOCK_N)
    return triton.cdiv(k_dim, _BLOCK) * triton.cdiv(n_dim, _BLOCK_N) < tiles
