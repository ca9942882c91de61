"""The Gluon kernels (Hopper FP8 GEMMs, dual quantizer) compile for sm_90a without a GPU.

The GPU tests in test_fp8_gemm.py and test_fp8_quant.py run them on the H200 against the
Triton kernels and the references, bit for bit; CI has no GPU, so here every variant is
compiled (Triton's pipeline down to ptxas, with a stand-in driver that names an sm_90
target) and checked for the invariants whose breakage hangs or refuses the launch instead
of failing a comparison: the shared memory fits the H200, each stage's mbarrier expects
exactly the bytes its TMA loads bring, and the registers are split between the consumer
warpgroups and the loader warp; and for the quantizer, the layout property it exists for.
The Triton SwiGLU kernels are compiled here too, for the instructions their sigmoid takes.
"""

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import mt_ops.fp8_gemm_hopper as hopper
import mt_ops.fp8_quant_gluon as quant_gluon
from mt_ops.fp8_quant import QUANT_CONFIG, Fp8Quantized, _launch_1x128, row_tiles

triton = pytest.importorskip("triton")
# Modules whose names the package's functions shadow as attributes of mt_ops.
swiglu = importlib.import_module("mt_ops.swiglu")
fp8_swiglu = importlib.import_module("mt_ops.fp8_swiglu")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
SM90_MAX_SHARED = 232448  # bytes of dynamic shared memory a block may use on the H100/H200
pytestmark = pytest.mark.skipif(
    not hopper.HAS_GLUON
    or torch.cuda.is_available()
    or not (PTXAS.exists() or shutil.which("ptxas")),
    reason="compiles with a stand-in driver (GPU machines run the kernels in test_fp8_gemm.py)",
)


class _Sm90Driver:
    """The parts of Triton's active driver that compiling (not launching) asks for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def compiled(monkeypatch):
    """Routes the kernels' launches to compilation; yields the list of (flags, kernel)."""
    from triton.runtime import driver  # noqa: PLC0415

    results = []

    def compile_only(kernel, grid, *args, **kwargs):
        flags = {k: v for k, v in kwargs.items() if k.isupper()}
        results.append((kernel.fn.__name__, flags, kernel.warmup(*args, grid=grid, **kwargs)))

    monkeypatch.setattr(hopper, "_launch", compile_only)
    monkeypatch.setattr(quant_gluon, "_launch", compile_only)
    monkeypatch.setattr(hopper, "num_sms", lambda device: 132)
    previous = driver._active  # None until first used; reset_active() would build a CUDA one
    driver.set_active(_Sm90Driver())
    try:
        yield results
    finally:
        driver.set_active(previous)
        for kernel in (
            hopper._grouped_gemm_kernel, hopper._grouped_wgrad_kernel, quant_gluon._dual_kernel
        ):
            kernel.device_caches.clear()  # nothing compiled for the stand-in is launched


def _expected_tx(name: str) -> int:
    a_tile, b_tile = 128 * 128, 256 * 128  # fp8 bytes of A [128, 128] and B [256, 128]
    scale_rows = (128 + 256) * 4  # wgrad: the K step's fp32 scale rows of A and B
    return a_tile + b_tile + (scale_rows if name == "_grouped_wgrad_kernel" else 0)


def test_every_variant_compiles_for_sm90_within_its_limits(compiled, tmp_path, monkeypatch):
    rows, k_dim, n_dim, groups = 1024, 768, 2048, 8
    tiles = row_tiles(torch.full((groups,), rows // groups), rows)
    fp8 = torch.float8_e4m3fn
    a = Fp8Quantized(torch.zeros(rows, k_dim, dtype=fp8), torch.ones(rows, k_dim // 128))
    b = Fp8Quantized(
        torch.zeros(groups, n_dim, k_dim, dtype=fp8), torch.ones(groups, n_dim // 128, k_dim // 128)
    )
    for out_dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(rows, n_dim, dtype=out_dtype)
        hopper.grouped_gemm(a, b, tiles, out)
        hopper.grouped_gemm(a, b, tiles, out, second=(a, b))
        hopper.grouped_gemm_pair(a, b, b, tiles, out, torch.empty_like(out))
    num_tiles = tiles.num_tiles
    a_t = Fp8Quantized(torch.zeros(num_tiles, n_dim, 128, dtype=fp8), torch.ones(num_tiles, n_dim))
    b_t = Fp8Quantized(torch.zeros(num_tiles, k_dim, 128, dtype=fp8), torch.ones(num_tiles, k_dim))
    hopper.grouped_wgrad(
        a_t, b_t, tiles, torch.empty(groups, n_dim, k_dim, dtype=torch.bfloat16), False
    )
    hopper.grouped_wgrad(a_t, b_t, tiles, torch.empty(groups, n_dim, k_dim), False)
    hopper.grouped_wgrad(a_t, b_t, tiles, torch.empty(groups, n_dim, k_dim), True)
    # K = 384 ends in a half-empty 256-column tile: outᵀ's tiles instead, stored transposed.
    monkeypatch.setitem(hopper.WGRAD, "transposed", True)
    b_384 = Fp8Quantized(torch.zeros(num_tiles, 384, 128, dtype=fp8), torch.ones(num_tiles, 384))
    hopper.grouped_wgrad(
        a_t, b_384, tiles, torch.empty(groups, n_dim, 384, dtype=torch.bfloat16), False
    )
    assert compiled[-1][1]["TRANSPOSED"]
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in compiled[-1][2].asm["ptx"]

    seen = {(name, tuple(sorted(flags.items()))) for name, flags, _ in compiled}
    assert len(seen) == 10  # 6 fprop/dgrad variants (second pair or paired, TMA store), 4 wgrad
    for name, flags, kernel in compiled:
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= SM90_MAX_SHARED, (name, flags, kernel.metadata.shared)
        expected = {f"{_expected_tx(name)}"}
        assert set(re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);", ptx)) == expected
        maxnreg = set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx))
        assert {str(hopper._CONSUMER_REGS), str(hopper._LOADER_REGS)} <= maxnreg, (name, flags)
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        if flags.get("TMA_STORE"):
            assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # the epilogue's TMA stores
        if name == "_grouped_wgrad_kernel" and not flags["ACCUMULATE"]:
            # The K step reads B's column scales after each product instead of holding them
            # through both: no accumulator spilled to local memory and back every step.
            assert _ptxas_registers_and_spills(ptx, tmp_path)[1] == 0, flags


def _ptxas_registers_and_spills(ptx: str, tmp_path: Path) -> tuple[int, int]:
    """Registers per thread and spill-store bytes ptxas reports for ``ptx`` (sm_90a)."""
    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    ptxas = str(PTXAS) if PTXAS.exists() else shutil.which("ptxas")
    report = subprocess.run(
        [ptxas, "--gpu-name", "sm_90a", "-v", str(source), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def test_dual_quantizer_compiles_for_sm90_without_byte_wide_shared_memory_traffic(
    compiled, monkeypatch, tmp_path
):
    # The launcher routes CUDA tensors on an sm_90 device here; CPU tensors stand in.
    monkeypatch.setattr(quant_gluon, "supported", lambda x: True)
    assert QUANT_CONFIG["dual_gluon"]
    x = torch.zeros(1000, 384, dtype=torch.bfloat16)
    tiles = row_tiles(torch.tensor([600, 0, 400]), 1000)
    source_rows = torch.zeros(1000, dtype=torch.int64)
    for scale_format in ("fp32", "e8m0"):
        _launch_1x128(x, None, True, True, scale_format)
        _launch_1x128(x, tiles, True, True, scale_format, source_rows, torch.ones(1000))
    assert len(compiled) == 4
    for name, flags, kernel in compiled:
        assert name == "_dual_kernel"
        ptx = kernel.asm["ptx"]
        # 3 programs per SM need <= 168 registers per thread, without spilling to reach it.
        registers, spills = _ptxas_registers_and_spills(ptx, tmp_path)
        assert registers <= quant_gluon.MAX_REGISTERS and spills == 0, (flags, registers, spills)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the in-register packing
        # The reason for the kernel: no fp8 bytes move through shared memory one at a time
        # (Triton's kernel: 156 such stores per warp and tile), only the column maxima.
        assert "st.shared.b8" not in ptx and "st.shared.u8" not in ptx, flags
        assert kernel.metadata.shared <= 4096, (flags, kernel.metadata.shared)


def test_swiglu_kernels_compile_their_sigmoid_to_the_fast_instructions(compiled, monkeypatch):
    # mt_ops._triton.sigmoid: the flush-to-zero ex2 and div.approx, not tl.sigmoid's
    # ex2.approx.f32 and div.full.f32 with their range checks (7 of 38 instructions per
    # element in the fused forward).
    kernels = []

    def compile_only(kernel, grid, *args, **kwargs):
        kernels.append((kernel, kernel.warmup(*args, grid=grid, **kwargs)))

    monkeypatch.setattr(swiglu, "launch", compile_only)
    monkeypatch.setattr(fp8_swiglu, "launch", compile_only)
    gate = torch.zeros(256, 384, dtype=torch.bfloat16)
    try:  # the caches are cleared even when a later compile fails
        swiglu._swiglu_fwd(gate, gate)
        swiglu._swiglu_bwd(gate, gate, gate)
        fp8_swiglu._launch_fwd(gate, gate, row_tiles(torch.tensor([200, 56]), 256), "fp32")
        assert len(kernels) == 3
        for kernel, binary in kernels:
            ptx = binary.asm["ptx"]
            assert "ex2.approx.ftz.f32" in ptx and "div.approx" in ptx, kernel.fn.__name__
            assert "div.full" not in ptx and "ex2.approx.f32" not in ptx, kernel.fn.__name__
    finally:
        for kernel, _ in kernels:
            kernel.device_caches.clear()  # compiled for the stand-in driver only
