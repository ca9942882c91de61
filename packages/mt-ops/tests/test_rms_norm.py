import pytest
import torch

from mt_ops import rms_norm, rms_norm_reference

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
