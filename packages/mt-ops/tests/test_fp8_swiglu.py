"""SwiGLU fused with FP8 quantization. Legend: R rows, F hidden, T row tiles."""

import itertools

import pytest
import torch

from mt_ops import swiglu
from mt_ops.fp8_quant import quantize_1x128_dual, row_tiles, scale_to_float
from mt_ops.fp8_swiglu import (
    SWIGLU_QUANT_CONFIG,
    _kernels_for_test,
    swiglu_backward_quantize_1x128,
    swiglu_backward_quantize_1x128_reference,
    swiglu_quantize_1x128,
    swiglu_quantize_1x128_reference,
)


def _inputs(num_rows, num_cols, device="cpu", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate, up, grad = (torch.randn(num_rows, num_cols, generator=gen) * 3 for _ in range(3))
    return [t.to(device, dtype) for t in (gate, up, grad)]


def _assert_same_quantization(got, ref, mostly_equal=None):
    """Scales equal; fp8 bytes equal, or with ``mostly_equal`` (conftest's fp8_mostly_equal,
    for the interpreter's casts) >= 75% equal and the rest explained by those casts."""
    for g, r in zip(got, ref, strict=True):
        assert g.data.shape == r.data.shape
        assert torch.equal(scale_to_float(g.scale), scale_to_float(r.scale))
        same = g.data.view(torch.uint8) == r.data.view(torch.uint8)
        fraction = float(same.float().mean()) if same.numel() else 1.0
        assert fraction == 1.0 if mostly_equal is None else mostly_equal(g.data, r.data), fraction


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("bwd_fused", [True, False])
def test_fused_kernels_match_references_in_interpreter(
    segmented, scale_format, bwd_fused, monkeypatch, fp8_mostly_equal
):
    # Both backward choices: the one-pass kernel, and SwiGLU backward + two quantizations.
    monkeypatch.setitem(SWIGLU_QUANT_CONFIG, "bwd_fused", bwd_fused)
    gate, up, grad = _inputs(300, 200, dtype=torch.float32)  # ragged in rows and columns
    tiles = row_tiles(torch.tensor([0, 130, 3, 167]), 300) if segmented else None
    fwd, bwd = _kernels_for_test()
    got = fwd(gate, up, tiles, scale_format)
    ref = swiglu_quantize_1x128_reference(gate, up, tiles=tiles, scale_format=scale_format)
    _assert_same_quantization(got, ref, fp8_mostly_equal)
    got_dgate, got_dup = bwd(grad, gate, up, tiles, scale_format)
    ref_dgate, ref_dup = swiglu_backward_quantize_1x128_reference(
        grad, gate, up, tiles=tiles, scale_format=scale_format
    )
    _assert_same_quantization(got_dgate, ref_dgate, fp8_mostly_equal)
    _assert_same_quantization(got_dup, ref_dup, fp8_mostly_equal)


def test_reference_gradients_are_swiglu_autograd_gradients():
    gate, up, grad = _inputs(64, 256, dtype=torch.float32, seed=1)
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    (g * torch.sigmoid(g) * u).backward(grad)
    (dgate_rows, _), (dup_rows, _) = swiglu_backward_quantize_1x128_reference(grad, gate, up)
    expected = quantize_1x128_dual(g.grad)[0], quantize_1x128_dual(u.grad)[0]
    for got, ref in zip((dgate_rows, dup_rows), expected, strict=True):
        assert torch.equal(scale_to_float(got.scale), scale_to_float(ref.scale))
        # fp32 formulas vs autograd differ in the last bits: rare fp8 rounding flips only
        assert float((got.data.float() == ref.data.float()).float().mean()) >= 0.99


def test_public_ops_fall_back_to_references_on_cpu_and_check_shapes():
    gate, up, grad = _inputs(10, 128)
    got = swiglu_quantize_1x128(gate, up)
    ref = swiglu_quantize_1x128_reference(gate, up)
    _assert_same_quantization(got, ref)
    with pytest.raises(ValueError, match="same 2-D"):
        swiglu_backward_quantize_1x128(grad[:, :64], gate, up)
    with pytest.raises(ValueError, match="tiles cover"):
        swiglu_quantize_1x128(gate, up, tiles=row_tiles(torch.tensor([3, 4]), 7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
@pytest.mark.parametrize("shape", [(4099, 768), (1023, 777), (0, 256)])
def test_fused_kernels_equal_unfused_swiglu_then_quantization_bit_for_bit_on_gpu(
    shape, scale_format, monkeypatch
):
    gate, up, grad = _inputs(*shape, device="cuda")
    counts = torch.tensor([shape[0] // 3, 0, shape[0] - shape[0] // 3], device="cuda")
    for tiles, bwd_fused in itertools.product((None, row_tiles(counts, shape[0])), (True, False)):
        monkeypatch.setitem(SWIGLU_QUANT_CONFIG, "bwd_fused", bwd_fused)
        got = swiglu_quantize_1x128(gate, up, tiles=tiles, scale_format=scale_format)
        unfused = quantize_1x128_dual(swiglu(gate, up), tiles=tiles, scale_format=scale_format)
        _assert_same_quantization(got, unfused)
        g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        swiglu(g, u).backward(grad)  # the Triton SwiGLU backward kernel
        got_dgate, got_dup = swiglu_backward_quantize_1x128(
            grad, gate, up, tiles=tiles, scale_format=scale_format
        )
        for got_q, unfused_grad in ((got_dgate, g.grad), (got_dup, u.grad)):
            expected = quantize_1x128_dual(unfused_grad, tiles=tiles, scale_format=scale_format)
            _assert_same_quantization(got_q, expected)
