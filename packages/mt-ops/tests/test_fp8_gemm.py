"""Block-scaled FP8 GEMMs. Legend: M rows, N out features, K contraction, G groups."""

import sys
import types

import pytest
import torch

import mt_ops.fp8_gemm as gemm_module
from mt_ops.fp8_gemm import (
    fp8_backend,
    fp8_grouped_gemm,
    fp8_grouped_gemm_pair,
    fp8_grouped_gemm_reference,
    fp8_grouped_gemm_sum,
    fp8_grouped_gemm_sum_reference,
    fp8_grouped_wgrad,
    fp8_grouped_wgrad_reference,
)
from mt_ops.fp8_quant import (
    Fp8Quantized,
    dequantize_1x128,
    dequantize_128x128,
    quantize_1x128_dual,
    quantize_128x128,
    row_tiles,
)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: 1 − 2Σxy / Σ(x² + y²)."""
    x, y = x.detach().double(), y.detach().double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _problem(counts, k_dim, n_dim, scale_format="fp32", device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(counts)
    x = torch.randn(num_rows, k_dim, generator=gen).to(device)
    w = (torch.randn(len(counts), n_dim, k_dim, generator=gen) / k_dim**0.5).to(device)
    dy = torch.randn(num_rows, n_dim, generator=gen).to(device)
    counts_G = torch.tensor(counts, device=device)
    tiles = row_tiles(counts_G, num_rows)
    xq, xqt = quantize_1x128_dual(x, tiles=tiles, scale_format=scale_format)
    (wq, wqt) = quantize_128x128(w, scale_format=scale_format, transpose=True)
    dyq, dyqt = quantize_1x128_dual(dy, tiles=tiles, scale_format=scale_format)
    return locals()


def _exact_grouped(x, w, counts):
    outs = [x_g @ w[g].T for g, x_g in enumerate(torch.split(x, counts))]
    return torch.cat(outs)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Routes the public GEMMs to the Triton kernels, run by the interpreter on CPU."""
    monkeypatch.setattr(gemm_module, "fp8_backend", lambda device, backend=None: "triton")


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_grouped_gemm_kernel_equals_emulation_in_interpreter(scale_format, triton_on_cpu):
    p = _problem([0, 130, 3, 0, 67], 192, 160, scale_format)
    tiles = p["tiles"]
    for a, b in ((p["xq"], p["wq"]), (p["dyq"], p["wqt"])):
        got = fp8_grouped_gemm(a, b, tiles, out_dtype=torch.float32)
        expected = fp8_grouped_gemm_reference(a, b, tiles, out_dtype=torch.float32)
        assert _relative(got, expected) <= 1e-5


def _second_pair(p, scale_format):
    """A second (rows, weight) pair over the same tiles with another K, as gate + up."""
    gen = torch.Generator().manual_seed(5)
    num_rows, n_dim = p["dy"].shape[0], p["x"].shape[1]
    a2 = torch.randn(num_rows, 288, generator=gen)
    w2 = torch.randn(p["w"].shape[0], n_dim, 288, generator=gen) / 17
    a2q, _ = quantize_1x128_dual(a2.to(p["x"].device), tiles=p["tiles"], scale_format=scale_format)
    w2q, _ = quantize_128x128(w2.to(p["x"].device), scale_format=scale_format)
    return a2q, w2q


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_grouped_gemm_sum_kernel_equals_emulation_of_both_products_in_interpreter(
    scale_format, triton_on_cpu
):
    p = _problem([0, 130, 3, 0, 67], 192, 160, scale_format)
    a2q, w2q = _second_pair(p, scale_format)
    # dgrad shape: dy [R, 160] @ wqt [G, 192, 160]ᵀ plus a2 [R, 288] @ w2 [G, 192, 288]ᵀ
    got = fp8_grouped_gemm_sum(p["dyq"], p["wqt"], a2q, w2q, p["tiles"], out_dtype=torch.float32)
    expected = fp8_grouped_gemm_sum_reference(
        p["dyq"], p["wqt"], a2q, w2q, p["tiles"], out_dtype=torch.float32
    )
    assert _relative(got, expected) <= 1e-5
    first = fp8_grouped_gemm_reference(p["dyq"], p["wqt"], p["tiles"], out_dtype=torch.float32)
    assert _relative(got, first) > 0.1  # the second product is really added


def test_grouped_gemm_sum_rejects_pairs_of_different_layers():
    p = _problem([10, 20], 128, 256)
    with pytest.raises(ValueError, match="must agree"):
        fp8_grouped_gemm_sum(p["xq"], p["wq"], p["dyq"], p["wqt"], p["tiles"])


@pytest.mark.parametrize("gemm", [fp8_grouped_gemm, fp8_grouped_gemm_reference])
def test_grouped_gemm_rejects_tiles_of_more_groups_than_weights(gemm):
    # Before, rows of a group without a weight were left zero (emulation) or unwritten
    # (the kernel's torch.empty output), silently.
    p = _problem([0, 130, 3, 0, 67], 192, 160)
    four_weights, _ = quantize_128x128(p["w"][:4].contiguous())
    with pytest.raises(ValueError, match="tiles have 5 groups but B holds 4 weights"):
        gemm(p["xq"], four_weights, p["tiles"], out_dtype=torch.float32)


def test_gemms_reject_operands_of_two_scale_formats(triton_on_cpu):
    # Before, the kernels raised KeyError('float8_e8m0fnu') and the emulation accepted them.
    p = _problem([0, 130, 3, 0, 67], 192, 160)
    w_e8m0, _ = quantize_128x128(p["w"], scale_format="e8m0")
    _, xqt_e8m0 = quantize_1x128_dual(p["x"], tiles=p["tiles"], scale_format="e8m0")
    message = r"A scale dtype \(torch.float32\) must equal B scale dtype \(torch.float8_e8m0fnu\)"
    for gemm in (fp8_grouped_gemm, fp8_grouped_gemm_reference):
        with pytest.raises(ValueError, match=message):
            gemm(p["xq"], w_e8m0, p["tiles"], out_dtype=torch.float32)
    for wgrad in (fp8_grouped_wgrad, fp8_grouped_wgrad_reference):
        with pytest.raises(ValueError, match=message):
            wgrad(p["dyqt"], xqt_e8m0, p["tiles"])


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_grouped_wgrad_kernel_equals_emulation_and_accumulates_in_interpreter(
    scale_format, triton_on_cpu
):
    p = _problem([0, 130, 3, 0, 67], 192, 160, scale_format)
    got = fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"])
    expected = fp8_grouped_wgrad_reference(p["dyqt"], p["xqt"], p["tiles"])
    assert _relative(got, expected) <= 1e-5
    assert torch.all(got[0] == 0) and torch.all(got[3] == 0)  # experts without tokens
    doubled = fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"], out=got.clone())
    assert _relative(doubled, 2 * expected) <= 1e-5
    # BF16 results (a BF16 parameter's gradient) round the fp32 accumulator once; the
    # interpreter's bf16 cast is not faithful, so the GPU test checks the bits.
    got_bf16 = fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"], out_dtype=torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16 and _relative(got_bf16, expected) <= 4e-3
    with pytest.raises(ValueError, match="must be float32"):
        fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"], out=got.bfloat16())


@pytest.mark.parametrize("hopper", [True, False])
def test_dense_wgrad_takes_the_hopper_kernel_over_cublas_where_it_runs(monkeypatch, hopper):
    # One group with the "torch" backend: cuBLAS only where the Hopper kernel cannot run
    # (it would read a side-by-side copy of the tile-major operands).
    p = _problem([300], 256, 128)
    calls = []
    monkeypatch.setattr(gemm_module, "fp8_backend", lambda device, backend=None: "torch")
    monkeypatch.setattr(gemm_module, "_use_hopper", lambda *operands, out: hopper)
    monkeypatch.setattr(
        gemm_module.fp8_gemm_hopper, "grouped_wgrad",
        lambda a_t, b_t, tiles, out, accumulate: calls.append(("hopper", out.shape)) or out,
    )  # fmt: skip
    monkeypatch.setattr(
        gemm_module, "_wgrad_torch",
        lambda a_t, b_t, out, out_dtype: calls.append(("cublas", out)) or torch.zeros(1),
    )  # fmt: skip
    fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"])
    assert calls == ([("hopper", (1, 128, 256))] if hopper else [("cublas", None)])


def test_tiles_side_by_side_is_the_tile_padded_matrix_cublas_reads():
    p = _problem([130, 0, 61], 256, 128)
    data = p["xqt"].data  # [T, K, 128]
    matrix = gemm_module._tiles_side_by_side(data)  # [K, 128·T]
    assert matrix.shape == (256, 128 * data.shape[0])
    for t in range(data.shape[0]):
        assert torch.equal(matrix[:, 128 * t : 128 * (t + 1)].view(torch.uint8),
                           data[t].view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("wgrad", [fp8_grouped_wgrad, fp8_grouped_wgrad_reference])
@pytest.mark.parametrize("shape", [(4, 160, 192), (5, 160, 1), (160, 192)])
def test_grouped_wgrad_rejects_an_out_of_another_shape_by_name(wgrad, shape):
    # Before: a broadcast RuntimeError in the emulation, and on GPU the kernel wrote
    # [G, N, K] through raw offsets past a smaller out.
    p = _problem([0, 130, 3, 0, 67], 192, 160)
    with pytest.raises(ValueError, match=r"out shape .* must be \[G, N, K\] = \[5, 160, 192\]"):
        wgrad(p["dyqt"], p["xqt"], p["tiles"], out=torch.zeros(shape))


def test_emulated_fp8_products_are_within_calc_diff_of_exact_products():
    counts = [100, 0, 37, 200]
    p = _problem(counts, 256, 384)
    y = fp8_grouped_gemm(p["xq"], p["wq"], p["tiles"], out_dtype=torch.float32)
    assert calc_diff(y, _exact_grouped(p["x"], p["w"], counts)) <= 1e-3
    dx = fp8_grouped_gemm(p["dyq"], p["wqt"], p["tiles"], out_dtype=torch.float32)
    exact_dx = torch.cat([g @ p["w"][e] for e, g in enumerate(torch.split(p["dy"], counts))])
    assert calc_diff(dx, exact_dx) <= 1e-3
    dw = fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"])
    splits = zip(torch.split(p["dy"], counts), torch.split(p["x"], counts), strict=True)
    exact_dw = torch.stack([g.T @ x for g, x in splits])
    assert calc_diff(dw, exact_dw) <= 1e-3


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_emulation_under_autocast_multiplies_in_fp32_as_outside(scale_format):
    # The backward of an FP8 linear runs under the training step's autocast (mt-train's
    # run_microbatches). Before, the emulation's matmuls were autocast to BF16 there: fp32
    # weight gradients and each product of a gemm_sum were rounded to BF16 (~2e-3 apart).
    p = _problem([0, 130, 3, 0, 67], 192, 160, scale_format)
    a2q, w2q = _second_pair(p, scale_format)
    tiles = p["tiles"]

    def products():
        return [
            fp8_grouped_gemm(p["xq"], p["wq"], tiles, out_dtype=torch.float32),
            fp8_grouped_gemm_sum(p["dyq"], p["wqt"], a2q, w2q, tiles, out_dtype=torch.float32),
            fp8_grouped_wgrad(p["dyqt"], p["xqt"], tiles),
            fp8_grouped_wgrad(p["dyqt"], p["xqt"], tiles, out=torch.ones(5, 160, 192)),
        ]

    expected = products()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = products()
    for name, g, e in zip(["gemm", "gemm_sum", "wgrad", "wgrad into out"], got, expected,
                          strict=True):  # fmt: skip
        assert g.dtype == torch.float32 and torch.equal(g, e), name


def test_backend_is_emulation_on_cpu_and_overrides_are_checked(monkeypatch):
    monkeypatch.delenv("MT_OPS_FP8_BACKEND", raising=False)
    assert fp8_backend(torch.device("cpu")) == "emulation"
    with pytest.raises(ValueError, match="needs CUDA"):
        fp8_backend(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="must be one of"):
        fp8_backend(torch.device("cpu"), "cutlass")
    monkeypatch.setenv("MT_OPS_FP8_BACKEND", "emulation")
    assert fp8_backend(torch.device("cpu")) == "emulation"
    # A choice from the environment says so: the caller passed no backend.
    monkeypatch.setenv("MT_OPS_FP8_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"MT_OPS_FP8_BACKEND='triton'.*needs CUDA"):
        fp8_backend(torch.device("cpu"))
    monkeypatch.setenv("MT_OPS_FP8_BACKEND", "auto")
    with pytest.raises(ValueError, match=r"MT_OPS_FP8_BACKEND='auto'.*one of.*unset"):
        fp8_backend(torch.device("cpu"))


def test_deepgemm_is_chosen_when_it_imports_and_called_with_its_dense_convention(monkeypatch):
    # DeepGEMM cannot be built here; a stand-in module with its fp8_gemm_nt signature
    # ((A, scales [M, K/128]), (B [N, K], scales [N/128, K/128]), out [M, N]) checks the
    # selection and that the hook passes the operands it documents, computing like it.
    calls = []

    def fp8_gemm_nt(a, b, out):
        (a_data, a_scale), (b_data, b_scale) = a, b
        calls.append((a_data.shape, a_scale.shape, a_scale.dtype, b_data.shape, b_scale.shape))
        a_MK = dequantize_1x128(Fp8Quantized(a_data, a_scale))
        b_NK = dequantize_128x128(Fp8Quantized(b_data[None], b_scale[None]))[0]
        out.copy_(a_MK @ b_NK.T)

    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt))
    monkeypatch.delenv("MT_OPS_FP8_BACKEND", raising=False)
    gemm_module._deep_gemm.cache_clear()
    try:
        assert fp8_backend(torch.device("cuda")) == "deepgemm"
        assert fp8_backend(torch.device("cpu")) == "emulation"
        p = _problem([300], 256, 384, scale_format="e8m0")
        got = gemm_module._dense_deepgemm(p["xq"], p["wq"], torch.float32)
        expected = fp8_grouped_gemm_reference(p["xq"], p["wq"], p["tiles"], out_dtype=torch.float32)
        assert torch.equal(got, expected)
        assert calls == [((300, 256), (300, 2), torch.float32, (384, 256), (3, 2))]
    finally:
        monkeypatch.undo()  # the stand-in leaves sys.modules before the cache is cleared
        gemm_module._deep_gemm.cache_clear()
    assert gemm_module._deep_gemm() is None


# Hopper's FP8 tensor cores add products inside each 128-wide K block with fewer than fp32's
# mantissa bits (the kernels promote to fp32 once per block, DeepSeek-V3's recipe, as
# DeepGEMM does); measured 1.3e-4 against the exact fp32 emulation (1.2e-4 for wgrad) and
# 4.6e-5 even when promoting after every instruction. So fp32 outputs are checked to 3e-4,
# not the 1e-5 of a true fp32 kernel; bf16 outputs are bounded by their own rounding.
HOPPER_FP8_ACCUMULATION = 3e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_gpu_fp8_gemms_equal_emulation_up_to_output_rounding(backend, scale_format):
    if backend == "torch" and torch.cuda.get_device_capability() == (9, 0):
        # On Hopper the dense case below (K % 512 == 0, one group) must take cuBLAS for
        # fprop and dgrad, not fall back; its wgrad takes the Hopper kernel with fp32
        # scales and cuBLAS with E8M0 ones.
        for recipe in gemm_module.SCALED_MM_RECIPES:
            assert gemm_module._scaled_mm_works(0, recipe), gemm_module.SCALED_MM_PROBE_ERRORS
    for counts, k_dim, n_dim in (([1024], 2048, 768), ([0, 300, 17, 0, 700, 1], 768, 2048)):
        p = _problem(counts, k_dim, n_dim, scale_format, device="cuda")
        tiles = p["tiles"]
        for a, b in ((p["xq"], p["wq"]), (p["dyq"], p["wqt"])):
            got = fp8_grouped_gemm(a, b, tiles, out_dtype=torch.float32, backend=backend)
            expected = fp8_grouped_gemm_reference(a, b, tiles, out_dtype=torch.float32)
            assert _relative(got, expected) <= HOPPER_FP8_ACCUMULATION, (counts, backend)
            got_bf16 = fp8_grouped_gemm(a, b, tiles, out_dtype=torch.bfloat16, backend=backend)
            assert _relative(got_bf16, expected) <= 4e-3
        dw = fp8_grouped_wgrad(p["dyqt"], p["xqt"], tiles, backend=backend)
        expected_dw = fp8_grouped_wgrad_reference(p["dyqt"], p["xqt"], tiles)
        assert _relative(dw, expected_dw) <= HOPPER_FP8_ACCUMULATION
        dw_bf16 = fp8_grouped_wgrad(
            p["dyqt"], p["xqt"], tiles, out_dtype=torch.bfloat16, backend=backend
        )
        hopper = scale_format == "fp32" and torch.cuda.get_device_capability() == (9, 0)
        if backend == "torch" and len(counts) == 1 and not hopper:  # cuBLAS may pick
            # another algorithm for another output dtype
            assert _relative(dw_bf16, expected_dw) <= 4e-3
        else:
            assert torch.equal(dw_bf16, dw.bfloat16())  # one rounding of the same accumulator
        main_grad = torch.full_like(expected_dw, 0.5)  # accumulating into an fp32 gradient
        fp8_grouped_wgrad(p["dyqt"], p["xqt"], tiles, out=main_grad, backend=backend)
        assert _relative(main_grad - 0.5, expected_dw) <= HOPPER_FP8_ACCUMULATION
        y = fp8_grouped_gemm(p["xq"], p["wq"], tiles, out_dtype=torch.float32, backend=backend)
        assert calc_diff(y, _exact_grouped(p["x"], p["w"], counts)) <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (where both cuBLAS recipes are known to work)",
)
def test_gpu_scaled_mm_probe_passes_when_first_asked_under_autocast():
    # The trainer's first FP8 GEMM runs inside an autocast forward; the probe's fp32
    # reference product must not be computed in BF16 there, or cuBLAS is never used.
    gemm_module._scaled_mm_works.cache_clear()
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for recipe in gemm_module.SCALED_MM_RECIPES:
                works = gemm_module._scaled_mm_works(0, recipe)
                assert works, gemm_module.SCALED_MM_PROBE_ERRORS
    finally:
        gemm_module._scaled_mm_works.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_gemm_sum_equals_emulation_up_to_accumulation():
    p = _problem([0, 300, 17, 0, 700, 1], 768, 2048, device="cuda")
    a2q, w2q = _second_pair(p, "fp32")
    got = fp8_grouped_gemm_sum(p["dyq"], p["wqt"], a2q, w2q, p["tiles"], out_dtype=torch.float32)
    expected = fp8_grouped_gemm_sum_reference(
        p["dyq"], p["wqt"], a2q, w2q, p["tiles"], out_dtype=torch.float32
    )
    assert _relative(got, expected) <= HOPPER_FP8_ACCUMULATION


TRITON = "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_gpu_kernel_paths_agree_bit_for_bit(monkeypatch, scale_format):
    # Every kernel path adds the same per-block products in the same order, so all agree in
    # every bit: on Hopper the warp-specialized Gluon kernels (128×256 tiles), then the
    # Triton kernels with TMA loads (persistent grouped GEMM whose whole row tiles are
    # written by TMA stores, 128×64 wgrad tiles), without TMA stores, not persistent, and
    # with pointer loads. Whole tiles, partial N, K and row tiles (masked stores that must
    # not touch the next group's rows), groups with no rows, BF16 and fp32 outputs, and
    # accumulation into an fp32 weight gradient. N or K of 640 and 384 end in a 256-column
    # tile whose second half lies past the end, as DeepSeek-V2-Lite's 1408 does.
    for counts, k_dim, n_dim in (
        ([0, 300, 17, 0, 700, 1], 768, 2048),
        ([0, 300, 17, 5], 272, 200),
        ([0, 300, 17, 0, 5], 384, 640),
        ([0, 0], 256, 128),
    ):
        p = _problem(counts, k_dim, n_dim, scale_format, device="cuda")
        a2q, w2q = _second_pair(p, scale_format)
        tiles = p["tiles"]
        main_grad = torch.randn(len(counts), n_dim, k_dim, device="cuda")

        def run(p=p, a2q=a2q, w2q=w2q, tiles=tiles, main_grad=main_grad):
            return (
                fp8_grouped_gemm(p["xq"], p["wq"], tiles, out_dtype=torch.float32, backend=TRITON),
                fp8_grouped_gemm(p["dyq"], p["wqt"], tiles, backend="triton"),
                fp8_grouped_gemm_sum(p["dyq"], p["wqt"], a2q, w2q, tiles, backend="triton"),
                fp8_grouped_wgrad(p["dyqt"], p["xqt"], tiles, backend="triton"),
                fp8_grouped_wgrad(
                    p["dyqt"], p["xqt"], tiles, out_dtype=torch.bfloat16, backend="triton"
                ),
                fp8_grouped_wgrad(
                    p["dyqt"], p["xqt"], tiles, out=main_grad.clone(), backend="triton"
                ),
            )

        assert gemm_module._use_tma(p["dyqt"].data) and gemm_module._use_tma(p["wq"].data)
        with monkeypatch.context() as patch:
            first = run()  # the Gluon kernels on Hopper
            patch.setitem(gemm_module.HOPPER, "enabled", False)
            with_tma = run()  # persistent Triton kernels
            for got, expected in zip(with_tma, first, strict=True):
                assert torch.equal(got, expected), counts
            patch.setitem(gemm_module.TMA, "store", False)
            for got, expected in zip(run(), with_tma, strict=True):
                assert torch.equal(got, expected), counts
            patch.setitem(gemm_module.TMA, "persistent", False)
            for got, expected in zip(run(), with_tma, strict=True):
                assert torch.equal(got, expected), counts
            patch.setitem(gemm_module.TMA, "enabled", False)
            for got, expected in zip(run(), with_tma, strict=True):
                assert torch.equal(got, expected), counts


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU",
)
def test_gpu_hopper_kernels_take_the_grouped_products(monkeypatch):
    # The bit-for-bit test above would pass if the Gluon kernels were never used.
    calls = []
    for name in ("grouped_gemm", "grouped_wgrad"):
        original = getattr(gemm_module.fp8_gemm_hopper, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(gemm_module.fp8_gemm_hopper, name, spy)
    p = _problem([0, 300, 17, 0, 700, 1], 768, 2048, device="cuda")
    fp8_grouped_gemm(p["xq"], p["wq"], p["tiles"], backend="triton")
    fp8_grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"], backend="triton")
    assert calls == ["grouped_gemm", "grouped_wgrad"]


@pytest.mark.parametrize("paired_kernel", [False, True])
def test_gemm_pair_equals_two_gemms_and_takes_the_paired_kernel_when_on(monkeypatch, paired_kernel):
    p = _problem([0, 130, 61], 256, 256)
    gen = torch.Generator().manual_seed(9)
    w2 = torch.randn(3, 256, 256, generator=gen) / 16
    (wq2, _) = quantize_128x128(w2)
    expected = [fp8_grouped_gemm(p["xq"], w, p["tiles"]) for w in (p["wq"], wq2)]
    got = fp8_grouped_gemm_pair(p["xq"], p["wq"], wq2, p["tiles"])  # emulation on CPU
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    calls = []
    monkeypatch.setitem(gemm_module.HOPPER, "pair", paired_kernel)
    monkeypatch.setattr(gemm_module, "fp8_backend", lambda device, backend=None: "triton")
    monkeypatch.setattr(gemm_module, "_use_hopper", lambda *operands, out: True)
    monkeypatch.setattr(
        gemm_module.fp8_gemm_hopper, "grouped_gemm_pair",
        lambda a, b, b2, tiles, out, out2: calls.append("pair") or (out, out2),
    )  # fmt: skip
    monkeypatch.setattr(
        gemm_module.fp8_gemm_hopper, "grouped_gemm",
        lambda a, b, tiles, out, second=None: calls.append("single") or out,
    )  # fmt: skip
    fp8_grouped_gemm_pair(p["xq"], p["wq"], wq2, p["tiles"])
    assert calls == (["pair"] if paired_kernel else ["single", "single"])
    # Operands the Hopper kernels cannot take: two GEMMs of the Triton path, switch or not.
    calls.clear()
    monkeypatch.setattr(gemm_module, "_use_hopper", lambda *operands, out: False)
    monkeypatch.setattr(
        gemm_module, "_grouped_gemm_triton",
        lambda a, b, tiles, out_dtype: calls.append("triton") or torch.empty(0),
    )  # fmt: skip
    fp8_grouped_gemm_pair(p["xq"], p["wq"], wq2, p["tiles"])
    assert calls == ["triton", "triton"]
    # One group under "torch": the dense library GEMM twice, as fp8_grouped_gemm routes.
    calls.clear()
    monkeypatch.setattr(gemm_module, "_use_hopper", lambda *operands, out: True)
    monkeypatch.setattr(gemm_module, "fp8_backend", lambda device, backend=None: "torch")
    monkeypatch.setattr(
        gemm_module, "_dense_torch", lambda a, b, out_dtype: calls.append("dense") or torch.empty(0)
    )
    one = _problem([130], 256, 256)
    (wq2_one, _) = quantize_128x128(w2[:1].contiguous())
    fp8_grouped_gemm_pair(one["xq"], one["wq"], wq2_one, one["tiles"])
    assert calls == ["dense", "dense"]
    (narrow, _) = quantize_128x128(w2[:, :128].contiguous())
    with pytest.raises(ValueError, match="paired weights"):
        fp8_grouped_gemm_pair(p["xq"], p["wq"], narrow, p["tiles"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU",
)
@pytest.mark.parametrize("counts", [[1536] * 2, [0, 300, 17, 0, 700, 1], [5, 0, 0]])
def test_gpu_transposed_wgrad_tiles_equal_plain_tiles_bit_for_bit(monkeypatch, counts):
    # out [N, K] whose K ends in a half-empty 256-column tile: the Hopper kernel computes
    # outᵀ's tiles (A and B swapped) and stores them transposed. The same products and
    # power-of-two scales (exact in either order): the same bits as the plain tiles.
    # K = 1408 is DeepSeek-V2-Lite's down projection; N = 640 and 384 end in a 256-row
    # tile of outᵀ whose second warpgroup lies past N and must not store (into the next
    # group's rows); groups without rows must come out zero.
    hopper = gemm_module.fp8_gemm_hopper
    transposed = []
    launch = hopper._launch

    def recording_launch(kernel, grid, *args, **kwargs):
        transposed.append(kwargs.get("TRANSPOSED"))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(hopper, "_launch", recording_launch)
    for k_dim, n_dim in ((1408, 2048), (384, 512), (384, 640), (128, 384)):
        p = _problem(counts, k_dim, n_dim, device="cuda")
        outs = []
        for on in (True, False):
            monkeypatch.setitem(hopper.WGRAD, "transposed", on)
            out = torch.full((len(counts), n_dim, k_dim), float("nan"), device="cuda")
            out = out.bfloat16()
            outs.append(hopper.grouped_wgrad(p["dyqt"], p["xqt"], p["tiles"], out, False))
        assert transposed[-2:] == [True, False], (k_dim, n_dim)
        got, plain = outs
        assert not got.isnan().any(), (counts, k_dim, n_dim)  # every element written
        assert torch.equal(got, plain), (counts, k_dim, n_dim)
        expected = fp8_grouped_wgrad_reference(p["dyqt"], p["xqt"], p["tiles"])
        assert _relative(got.float(), expected) <= 4e-3, (counts, k_dim, n_dim)  # BF16
        empty = [g for g, count in enumerate(counts) if count == 0 and bool(got[g].any())]
        assert not empty, empty


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU",
)
@pytest.mark.parametrize("counts", [[1536] * 4, [0, 700, 300, 1, 1047]])  # N: 1408 and 768
def test_gpu_paired_kernel_equals_two_gemms_bit_for_bit(monkeypatch, counts):
    monkeypatch.setitem(gemm_module.HOPPER, "pair", True)
    paired = []
    kernel = gemm_module.fp8_gemm_hopper.grouped_gemm_pair
    monkeypatch.setattr(gemm_module.fp8_gemm_hopper, "grouped_gemm_pair",
                        lambda *args: paired.append(1) or kernel(*args))  # fmt: skip
    for n_dim in (1408, 768, 1400):  # 1400: a last 128-column block that is partly past N
        p = _problem(counts, 2048, n_dim, device="cuda")
        gen = torch.Generator().manual_seed(9)
        # 3x the first weight's spread: most 128x128 blocks get another power-of-two
        # scale, so a warpgroup reading the other weight's scales cannot pass.
        w2 = (torch.randn(len(counts), n_dim, 2048, generator=gen) / 15).cuda()
        (wq2, _) = quantize_128x128(w2)
        for out_dtype in (torch.bfloat16, torch.float32):
            got = fp8_grouped_gemm_pair(p["xq"], p["wq"], wq2, p["tiles"], out_dtype=out_dtype)
            for g, w in zip(got, (p["wq"], wq2), strict=True):
                expected = fp8_grouped_gemm(p["xq"], w, p["tiles"], out_dtype=out_dtype)
                assert torch.equal(g, expected), (counts, n_dim, out_dtype)
    assert len(paired) == 6  # the paired kernel ran each time, not two plain GEMMs
