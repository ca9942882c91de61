import importlib
import math

import pytest
import torch

from mt_ops import rms_norm, rms_norm_reference
from mt_ops.rms_norm import _kernel_function_for_test

# The module (the package exports the function under the same name): its block constants.
rms_norm_module = importlib.import_module("mt_ops.rms_norm")

SHAPES = [(4, 64), (3, 37, 77), (0, 64)]  # 77: not a multiple of any block; 0: empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference_forward_and_backward(
    shape, dtype, assert_close, run_with_grads
):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out, grads = run_with_grads(rms_norm, [x, w])
    ref_out, ref_grads = run_with_grads(rms_norm_reference, [x, w])
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    for name, g, rg in zip(["x", "weight"], grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


def test_rms_norm_reference_matches_float64_formula():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 77, generator=gen, dtype=torch.float64)
    w = torch.randn(77, generator=gen, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    got = rms_norm_reference(x.float(), w.float())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_output_has_unit_rms_with_unit_weight():
    x = torch.randn(8, 256) * 7.0
    out = rms_norm(x, torch.ones(256))
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(8), rtol=1e-4, atol=1e-4)


def test_rms_norm_rejects_weight_of_wrong_size():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7))


@pytest.mark.parametrize("eps", [-1.0, math.nan])
@pytest.mark.parametrize("fn", [rms_norm, rms_norm_reference])
def test_a_negative_or_nan_eps_is_refused_by_name(fn, eps):
    # Before: NaN rows wherever the mean square was below -eps (all of them for NaN eps).
    with pytest.raises(ValueError, match=rf"eps \({eps}\) must be >= 0"):
        fn(torch.randn(2, 8), torch.ones(8), eps=eps)


def test_rms_norm_and_reference_refuse_integer_and_bool_x_naming_the_dtype():
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        for norm in (rms_norm, rms_norm_reference):
            with pytest.raises(ValueError, match=rf"x dtype \({dtype}\) must be a floating"):
                norm(torch.ones(2, 8, dtype=dtype), torch.ones(8))


# The kernel path on CPU tensors runs in Triton's interpreter, which mis-rounds casts to
# bf16: a case with a bf16 input or weight is held to bf16's tolerance throughout.
KERNEL_CASES = {
    # D = 77 pads to 128; 3 × 37 = 111 rows: 56 steps of 2 (the last ragged) over 3 programs.
    "fp32, ragged rows and D": ((3, 37, 77), torch.float32, torch.float32),
    "fp32, D a power of two": ((2, 5, 64), torch.float32, torch.float32),
    "empty": ((0, 77), torch.float32, torch.float32),
    "bf16 weight, fp32 x": ((37, 77), torch.float32, torch.bfloat16),
    "fp32 weight, bf16 x": ((37, 77), torch.bfloat16, torch.float32),
}


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrinks a step to 256 elements (two rows of D = 77) so small tensors take many."""
    monkeypatch.setattr(rms_norm_module, "_RMS_NORM_TILE", 256)
    return monkeypatch


@pytest.mark.parametrize("max_block", [8192, 32])  # 32: each row of 77 walked in three blocks
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_rms_norm_kernel_matches_reference_in_interpreter(
    case, max_block, small_blocks, assert_close, run_with_grads
):
    small_blocks.setattr(rms_norm_module, "_RMS_NORM_MAX_BLOCK", max_block)
    shape, x_dtype, w_dtype = KERNEL_CASES[case]
    tol = torch.bfloat16 if torch.bfloat16 in (x_dtype, w_dtype) else torch.float32
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen).to(x_dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(w_dtype)
    out, (dx, dw) = run_with_grads(_kernel_function_for_test(), [x, w])
    ref_out, (ref_dx, ref_dw) = run_with_grads(rms_norm_reference, [x, w])
    assert (out.dtype, dx.dtype, dw.dtype) == (x_dtype, x_dtype, w_dtype)
    assert dw.shape == w.shape and (x.numel() or not dw.any())  # no rows: a zero gradient
    assert_close(out, ref_out, tol, "out")
    assert_close(dx, ref_dx, tol, "grad x")
    assert_close(dw, ref_dw, tol, "grad weight")


@pytest.mark.parametrize("layout", ["row slice", "transposed"])
def test_rms_norm_kernel_reads_strided_x_and_gradient(
    layout, small_blocks, assert_close, run_with_grads
):
    # A slice of a wider projection (MLA's latent) is read in place with its row stride; a
    # transposed matrix (columns not contiguous) is copied first. The gradient is transposed.
    gen = torch.Generator().manual_seed(3)
    if layout == "row slice":
        x = torch.randn(4, 9, 100, generator=gen)[..., 11:88]  # [4, 9, 77], row stride 100
    else:
        x = torch.randn(77, 36, generator=gen).T  # [36, 77], column stride 36
    w = 1 + 0.1 * torch.randn(77, generator=gen)
    grad = torch.randn(x.shape[::-1], generator=gen).permute(*reversed(range(x.dim())))
    rms_norm_kernel = _kernel_function_for_test()
    grads = {}
    for name, fn in (("kernel", rms_norm_kernel), ("reference", rms_norm_reference)):
        x_leaf, w_leaf = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(x_leaf, w_leaf).backward(grad)
        grads[name] = x_leaf.grad, w_leaf.grad
    assert_close(rms_norm_kernel(x, w), rms_norm_reference(x, w), torch.float32, "out")
    for got, want, what in zip(grads["kernel"], grads["reference"], ["x", "weight"], strict=True):
        assert_close(got, want, torch.float32, f"grad {what}")


@pytest.mark.parametrize("wanted", ["x", "weight"])
def test_rms_norm_kernel_returns_only_requested_gradients(wanted, small_blocks, assert_close):
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(37, 77, generator=gen), 1 + 0.1 * torch.randn(77, generator=gen)
    grad = torch.randn(37, 77, generator=gen)
    got_x, got_w = x.clone().requires_grad_(wanted == "x"), w.clone().requires_grad_(wanted != "x")
    _kernel_function_for_test()(got_x, got_w).backward(grad)
    ref_x, ref_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rms_norm_reference(ref_x, ref_w).backward(grad)
    got, want, unwanted = (
        (got_x.grad, ref_x.grad, got_w.grad)
        if wanted == "x"
        else (got_w.grad, ref_w.grad, got_x.grad)
    )
    assert unwanted is None
    assert_close(got, want, torch.float32, f"grad {wanted}")


GPU_CASES = [
    ((4, 4096, 32, 128), torch.bfloat16, torch.float32),  # Qwen3 q_norm under autocast
    ((16384, 2048), torch.float32, torch.float32),  # a hidden-state norm
    ((3, 37, 77), torch.bfloat16, torch.bfloat16),  # ragged rows and D, a bf16 model
    ((300, 12000), torch.bfloat16, torch.float32),  # rows past one block: walked in blocks
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("shape", "x_dtype", "w_dtype"), GPU_CASES)
def test_rms_norm_kernel_on_gpu_matches_reference(
    shape, x_dtype, w_dtype, assert_close, run_with_grads
):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen).to("cuda", x_dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to("cuda", w_dtype)
    out, (dx, dw) = run_with_grads(rms_norm, [x, w])
    ref_out, (ref_dx, ref_dw) = run_with_grads(rms_norm_reference, [x, w])
    assert (out.dtype, dx.dtype, dw.dtype) == (x_dtype, x_dtype, w_dtype)
    if x_dtype == torch.float32:
        assert_close(out, ref_out, torch.float32, "out")
    else:
        # Same fp32 math and roundings, but rstd's sum runs in another order: where x·rstd
        # lies within an fp32 ulp or two of a bf16 rounding boundary, n = round(x·rstd)
        # lands one bf16 ulp away, which moves w·n by up to w's mantissa (< 2) ulps of y:
        # rarely, and by at most 2 ulps, 2**-6 of y's magnitude.
        differ = (out != ref_out).float().mean().item()
        assert differ <= 1e-3, differ
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-6, atol=1e-6)
    assert_close(dx, ref_dx, x_dtype, "grad x")
    assert_close(dw, ref_dw, w_dtype, "grad weight")


def _last_rows_match_reference(shape, device, assert_close, norm=rms_norm):
    """Output and input gradient of the last rows against the reference on those rows
    alone (each row is normalized by itself)."""
    gen = torch.Generator(device=device).manual_seed(6)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen, device=device)
    out = norm(x, w)
    grad = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    (dx,) = torch.autograd.grad(out, x, grad)
    x_last = x.detach()[-3:].requires_grad_(True)
    ref = rms_norm_reference(x_last, w)
    (ref_dx,) = torch.autograd.grad(ref, x_last, grad[-3:])
    assert_close(out[-3:], ref, torch.bfloat16, "out")
    assert_close(dx[-3:], ref_dx, torch.bfloat16, "grad x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [4096, 12000])  # rows in registers, rows walked in blocks
def test_rms_norm_kernel_on_gpu_addresses_rows_past_2_to_the_31_elements(dim, assert_close):
    # 2**31 // dim + 3 rows (4 GiB of bf16): the last rows' offsets overflow int32, so they
    # are right only if every offset is int64.
    _last_rows_match_reference((2**31 // dim + 3, dim), "cuda", assert_close)
