import pytest
import torch

from mt_ops import clamped_swiglu, clamped_swiglu_reference


def _gate_up(shape, dtype, seed=0, spread=6.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * spread).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1023, 2 * 777), (4, 3, 16), (0, 8)])
def test_clamped_swiglu_matches_reference_forward_and_backward(
    shape, dtype, assert_close, run_with_grads
):
    x = _gate_up(shape, dtype)
    out, (grad,) = run_with_grads(lambda t: clamped_swiglu(t, 1.702, 7.0), [x])
    ref, (ref_grad,) = run_with_grads(lambda t: clamped_swiglu_reference(t, 1.702, 7.0), [x])
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, ref, dtype, "out")
    assert_close(grad, ref_grad, dtype, "grad")


def test_clamped_swiglu_reads_gate_at_even_and_up_at_odd_indices_float64():
    gate = torch.tensor([-3.0, 0.5, 9.0, 2.0], dtype=torch.float64)
    up = torch.tensor([1.0, -8.0, 0.25, 7.5], dtype=torch.float64)
    gate_up = torch.stack((gate, up), dim=-1).flatten()  # interleaved
    g = gate.clamp(max=7.0)
    expected = (up.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
    torch.testing.assert_close(clamped_swiglu(gate_up), expected)
    torch.testing.assert_close(clamped_swiglu_reference(gate_up), expected)


@pytest.mark.parametrize("fn", [clamped_swiglu, clamped_swiglu_reference])
def test_float64_gate_up_passes_gradcheck_and_is_not_rounded_to_fp32(fn):
    # Before, fp64 inputs were computed in fp32 (``.float()``): outputs off by ~1e-7
    # relative and finite-difference gradients off by orders of magnitude.
    x = _gate_up((3, 10), torch.float64, seed=2, spread=4.0).requires_grad_()
    gate, up = x.detach()[..., 0::2], x.detach()[..., 1::2]
    g = gate.clamp(max=7.0)
    expected = (up.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
    torch.testing.assert_close(fn(x).detach(), expected, rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("bad", [dict(alpha=float("nan")), dict(limit=float("nan"))])
def test_nan_alpha_or_limit_is_rejected(bad):
    # Before, NaN passed the ``<= 0`` check and every output was NaN.
    with pytest.raises(ValueError, match="must be > 0"):
        clamped_swiglu(torch.randn(2, 4), **bad)


def test_clamping_stops_the_gradient_beyond_the_limit():
    x = torch.tensor([[9.0, 8.0, 1.0, -9.0]], requires_grad=True)  # gate 9 and up 8 clamped
    clamped_swiglu(x, 1.702, 7.0).sum().backward()
    assert x.grad[0, 0] == 0 and x.grad[0, 1] == 0 and x.grad[0, 3] == 0
    assert x.grad[0, 2] != 0


@pytest.mark.parametrize("fn", [clamped_swiglu, clamped_swiglu_reference])
def test_very_negative_gates_have_zero_output_and_finite_gradient(fn):
    # The reference's gate / (1 + exp(-alpha·gate)) overflowed exp in fp32 below a gate of
    # about -52: output -0, but a NaN gradient (0 · inf).
    x = torch.tensor([[-60.0, 1.0, -200.0, 2.0, -3.0, 0.5]], requires_grad=True)
    fn(x).sum().backward()
    assert torch.isfinite(x.grad).all(), x.grad
    assert x.grad[0, 0] == 0 and x.grad[0, 2] == 0 and x.grad[0, 4] != 0


def test_clamped_swiglu_rejects_odd_width_and_bad_constants():
    with pytest.raises(ValueError, match="even last dim"):
        clamped_swiglu(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="alpha"):
        clamped_swiglu(torch.zeros(2, 4), alpha=0.0)
