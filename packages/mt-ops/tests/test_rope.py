import pytest
import torch

from mt_ops import apply_rope, apply_rope_reference


def _cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None]  # [S, hd/2]
    emb = torch.cat((angles, angles), dim=-1)  # [S, hd]
    return emb.cos(), emb.sin(), angles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 4, 32), (1, 37, 3, 78), (2, 0, 4, 32)])
def test_apply_rope_matches_reference_forward_and_backward(
    shape, dtype, assert_close, run_with_grads
):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin, _ = _cos_sin(shape[1], shape[3])
    cos, sin = cos.float(), sin.float()
    out, grads = run_with_grads(lambda x: apply_rope(x, cos, sin), [x])
    ref_out, ref_grads = run_with_grads(lambda x: apply_rope_reference(x, cos, sin), [x])
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(grads[0], ref_grads[0], dtype, "grad x")


def test_apply_rope_equals_complex_multiplication_of_half_pairs():
    batch, seq_len, heads, head_dim = 2, 19, 3, 16
    x = torch.randn(batch, seq_len, heads, head_dim, dtype=torch.float64)
    cos, sin, angles = _cos_sin(seq_len, head_dim)
    half = head_dim // 2
    z = torch.complex(x[..., :half], x[..., half:])  # pairs (i, i + hd/2)
    rotated = z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    got = apply_rope(x.float(), cos.float(), sin.float())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_apply_rope_accepts_batched_cos_sin_and_preserves_norm():
    x = torch.randn(2, 11, 4, 8)
    cos, sin, _ = _cos_sin(11, 8)
    batched = apply_rope(x, cos.float().expand(2, 11, 8), sin.float().expand(2, 11, 8))
    torch.testing.assert_close(batched, apply_rope(x, cos.float(), sin.float()))
    torch.testing.assert_close(batched.norm(dim=-1), x.norm(dim=-1))


def test_apply_rope_rejects_cos_of_wrong_length():
    cos, sin, _ = _cos_sin(10, 8)
    with pytest.raises(ValueError, match="cos shape"):
        apply_rope(torch.randn(1, 11, 2, 8), cos.float(), sin.float())
