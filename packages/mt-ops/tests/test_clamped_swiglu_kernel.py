"""The fused clamped-SwiGLU kernel against the owner's reference (clamped_swiglu.py)."""

import pytest
import torch

from mt_ops.clamped_swiglu import clamped_swiglu_reference
from mt_ops.clamped_swiglu_kernel import _kernel_function_for_test, clamped_swiglu_fused


def _gate_up(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 6).to(device, dtype)  # many values past ±7


def test_fused_clamped_swiglu_matches_reference_in_interpreter(assert_close, run_with_grads):
    fused = lambda gu: _kernel_function_for_test().apply(gu, 1.702, 7.0)
    gate_up = _gate_up((3, 37, 2 * 45), torch.float32)  # 4995 outputs: three ragged blocks
    out, grads = run_with_grads(fused, [gate_up])
    ref_out, ref_grads = run_with_grads(clamped_swiglu_reference, [gate_up])
    assert out.shape == (3, 37, 45)
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(grads[0], ref_grads[0], torch.float32, "grad gate_up")


def test_fused_clamped_swiglu_runs_the_eager_op_on_cpu():
    gate_up = _gate_up((4, 16), torch.float32)
    torch.testing.assert_close(clamped_swiglu_fused(gate_up), clamped_swiglu_reference(gate_up))


def test_float64_gate_up_where_kernels_run_takes_the_float64_eager_op(monkeypatch):
    # Where kernels run (CUDA; here the interpreter stands in), fp64 went to the kernel,
    # which computes in fp32: ~1e-7 off the fp64 op, failing gradcheck.
    import mt_ops.clamped_swiglu_kernel as kernel_module
    from mt_ops.clamped_swiglu import clamped_swiglu

    monkeypatch.setattr(kernel_module, "use_kernels", lambda *tensors: True)
    gate_up = _gate_up((3, 10), torch.float64, seed=4)
    assert torch.equal(clamped_swiglu_fused(gate_up), clamped_swiglu(gate_up))
    assert torch.autograd.gradcheck(clamped_swiglu_fused, (gate_up.requires_grad_(),))
    out = clamped_swiglu_fused(_gate_up((3, 10), torch.float32).requires_grad_())
    assert "ClampedSwiGLUFn" in type(out.grad_fn).__name__  # fp32 still takes the kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_clamped_swiglu_on_gpu_matches_reference(dtype, assert_close, run_with_grads):
    gate_up = _gate_up((4099, 2 * 720), dtype, device="cuda")
    out, grads = run_with_grads(clamped_swiglu_fused, [gate_up])
    ref_out, ref_grads = run_with_grads(clamped_swiglu_reference, [gate_up])
    assert_close(out, ref_out, dtype, "out")
    assert_close(grads[0], ref_grads[0], dtype, "grad gate_up")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_clamped_swiglu_on_gpu_keeps_nan_where_clamp_does():
    # Triton's min/max return the non-NaN operand on CUDA unless told otherwise: a NaN
    # gate became the limit, a finite output that hid the NaN from the non-finite check.
    from mt_ops.clamped_swiglu import clamped_swiglu

    gate_up = _gate_up((64, 2 * 96), torch.float32, device="cuda")
    gate_up[3, 10] = gate_up[5, 21] = gate_up[7, 40] = float("nan")  # gates and ups
    grad = torch.randn(64, 96, device="cuda")
    results = []
    for op in (clamped_swiglu_fused, clamped_swiglu):
        x = gate_up.clone().requires_grad_()
        out = op(x)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    (out, dx), (ref, ref_dx) = results
    assert out.isnan().sum() == 3
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(dx, ref_dx, equal_nan=True)
