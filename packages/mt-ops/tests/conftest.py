"""Shared comparison helpers for the op tests (fixtures, since tests import no modules)."""

import pytest
import torch

# Relative L2 error ‖a − b‖ / ‖b‖ allowed between an op and its reference, by dtype: the
# rounding of the output dtype (ARCHITECTURE §4). bf16 keeps 8 bits: one rounding is ~2e-3.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"{actual.shape=}, {expected.shape=}"
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).norm()
    scale = expected.double().norm().clamp_min(1e-30)
    return float(diff / scale)


@pytest.fixture
def assert_close():
    """Returns ``check(actual, expected, dtype, what)`` asserting the dtype's L2 tolerance."""

    def check(actual, expected, dtype, what=""):
        err = _relative_error(actual, expected)
        tol = TOLERANCES[dtype]
        assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e} for {dtype}"

    return check


@pytest.fixture
def run_with_grads():
    """Returns ``run(fn, inputs, grad_out_seed)``: outputs and input grads of ``fn``."""

    def run(fn, inputs, seed=0):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        first = out[0] if isinstance(out, tuple) else out
        gen = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(first.shape, generator=gen).to(first.device, first.dtype)
        first.backward(grad_out)
        grads = [
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in leaves
            if t.is_floating_point()
        ]
        return first.detach(), grads

    return run
