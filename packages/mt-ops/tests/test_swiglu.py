import pytest
import torch
import torch.nn.functional as F

from mt_ops import swiglu, swiglu_reference


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


def test_swiglu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gate shape"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9))


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
