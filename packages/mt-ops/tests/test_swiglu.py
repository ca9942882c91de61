import importlib

import pytest
import torch
import torch.nn.functional as F

from mt_ops import swiglu, swiglu_reference
from mt_ops._triton import HAS_TRITON, sigmoid, tl, triton

if HAS_TRITON:

    @triton.jit
    def _both_sigmoids(x_ptr, ours_ptr, triton_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        tl.store(ours_ptr + offs, sigmoid(x), mask=ok)
        tl.store(triton_ptr + offs, tl.sigmoid(x), mask=ok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 96), (37, 77), (0, 96)])
def test_swiglu_matches_reference_forward_and_backward(shape, dtype, assert_close, run_with_grads):
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(shape, generator=gen).to(dtype)
    up = torch.randn(shape, generator=gen).to(dtype)
    out, grads = run_with_grads(swiglu, [gate, up])
    ref_out, ref_grads = run_with_grads(swiglu_reference, [gate, up])
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    for name, g, rg in zip(["gate", "up"], grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


def test_swiglu_reference_matches_float64_formula():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, 9, 33, generator=gen, dtype=torch.float64)
    expected = gate / (1 + torch.exp(-gate)) * up
    got = swiglu_reference(gate.float(), up.float())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up)


def test_swiglu_reference_of_float64_inputs_equals_the_op_and_passes_gradcheck():
    # Before, the reference rounded fp64 inputs through fp32 (``.float()``): ~1e-7 off the
    # op (eager fp64 on CPU), and finite differences of it fail gradcheck.
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(2, 4, 7, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(swiglu_reference(gate, up), swiglu(gate, up), rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(swiglu_reference, (gate.requires_grad_(), up.requires_grad_()))


def test_swiglu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gate shape"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9))


@pytest.mark.parametrize("fn", [swiglu, swiglu_reference])
def test_swiglu_rejects_gate_and_up_of_different_dtypes_under_autocast_too(fn):
    # Before, the eager op returned the promoted dtype (fp32) and the reference gate's (bf16).
    gate, up = torch.randn(2, 4, 8)
    match = r"up dtype \(torch.float32\) must equal gate dtype \(torch.bfloat16\); pass up.to"
    with pytest.raises(ValueError, match=match):
        fn(gate.bfloat16(), up)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=match):
        fn(gate.bfloat16(), up)


def test_swiglu_of_two_projections_under_autocast_matches_reference(assert_close, run_with_grads):
    # fp32 weights under autocast: both projections come out bf16, as the MLP feeds them.
    gen = torch.Generator().manual_seed(3)
    x, w_gate, w_up = torch.randn(3, 16, 32, generator=gen)

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            call = lambda x, wg, wu: fn(F.linear(x, wg), F.linear(x, wu))
            return run_with_grads(call, [x, w_gate, w_up])

    (out, grads), (ref_out, ref_grads) = run(swiglu), run(swiglu_reference)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert_close(out.float(), ref_out.float(), torch.bfloat16, "out")
    for name, g, rg in zip(["x", "w_gate", "w_up"], grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        assert_close(g, rg, torch.bfloat16, f"grad {name}")


def test_float64_swiglu_where_kernels_run_is_the_float64_eager_op(monkeypatch):
    # Where kernels run (CUDA; here the interpreter stands in), fp64 went to the fused
    # kernel, which computes in fp32: ~1e-8 off the fp64 op, failing gradcheck. rms_norm
    # already sent dtypes other than fp32/bf16/fp16 to the eager path.
    swiglu_module = importlib.import_module("mt_ops.swiglu")  # (mt_ops.swiglu: the function)
    monkeypatch.setattr(swiglu_module, "use_kernels", lambda *tensors: True)
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    assert torch.equal(swiglu(gate, up), F.silu(gate) * up)
    assert torch.autograd.gradcheck(swiglu, (gate.requires_grad_(), up.requires_grad_()))
    out = swiglu(*torch.randn(2, 3, 5, generator=gen, requires_grad=True))
    assert "SwiGLUFn" in type(out.grad_fn).__name__  # fp32 still takes the kernel


def test_fused_swiglu_kernel_matches_reference_in_interpreter(assert_close, run_with_grads):
    from mt_ops.swiglu import _kernel_function_for_test

    fused = _kernel_function_for_test().apply
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(2, 37, 177, generator=gen)  # 6549 elements: two ragged blocks
    out, grads = run_with_grads(fused, [gate, up])
    ref_out, ref_grads = run_with_grads(swiglu_reference, [gate, up])
    assert_close(out, ref_out, torch.float32, "out")
    for name, g, rg in zip(["gate", "up"], grads, ref_grads, strict=True):
        assert_close(g, rg, torch.float32, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_on_gpu_matches_reference(dtype, assert_close, run_with_grads):
    gate = torch.randn(4099, 768, device="cuda").to(dtype)
    up = torch.randn(4099, 768, device="cuda").to(dtype)
    out, grads = run_with_grads(swiglu, [gate, up])
    ref_out, ref_grads = run_with_grads(swiglu_reference, [gate, up])
    assert_close(out, ref_out, dtype, "out")
    for name, g, rg in zip(["gate", "up"], grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_sigmoid_equals_tl_sigmoid_above_minus_87():
    # Every bf16 value (the kernels' usual input), then fp32 values across the range.
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = torch.cat([
        every_bf16.view(torch.bfloat16).float(),
        torch.linspace(-87, 90, 2**20), torch.randn(2**20) * 20,
    ]).cuda()  # fmt: skip
    ours, expected = torch.empty_like(x), torch.empty_like(x)
    _both_sigmoids[(triton.cdiv(x.numel(), 1024),)](x, ours, expected, x.numel(), BLOCK=1024)
    above = torch.isfinite(x) & (x > -87)
    assert torch.equal(ours[above], expected[above])
    # Below, div.approx flushes tl.sigmoid's denormal results (1 / (1 + e^-x) < 2^-126) to 0.
    assert (ours[torch.isfinite(x) & (x < -88)] == 0).all()
    assert torch.equal(ours[x == float("inf")], expected[x == float("inf")])
