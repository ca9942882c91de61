import math

import pytest
import torch

from mt_ops import attention, attention_reference

# (B, Hq, Hkv, S, D): MHA, GQA, an odd length, and an empty sequence.
CASES = [(2, 4, 4, 16, 32), (1, 4, 2, 37, 24), (1, 6, 2, 0, 16)]


def _qkv(case, dtype, seed=0):
    batch, hq, hkv, seq, dim = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, seq, dim, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, seq, dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, seq, dim, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference_forward_and_backward(
    case, dtype, causal, assert_close, run_with_grads
):
    q, k, v = _qkv(case, dtype)
    out, grads = run_with_grads(lambda *t: attention(*t, causal=causal), [q, k, v])
    ref_out, ref_grads = run_with_grads(
        lambda *t: attention_reference(*t, causal=causal), [q, k, v]
    )
    assert out.shape == (case[0], case[1], case[3], case[4]) and out.dtype == dtype
    # The reference computes in fp32 from the bf16 inputs; SDPA rounds P to bf16 before
    # P @ V, so bf16 differences are a few roundings.
    assert_close(out, ref_out, dtype, "out")
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


@pytest.mark.parametrize("causal", [True, False])
def test_attention_reference_matches_float64_softmax_formula(causal):
    q, k, v = _qkv((2, 4, 2, 13, 8), torch.float64)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ kr.transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores + torch.full((13, 13), float("-inf"), dtype=torch.float64).triu(1)
    expected_out = torch.softmax(scores, dim=-1) @ vr
    expected_lse = torch.logsumexp(scores, dim=-1)
    out, lse = attention_reference(q.float(), k.float(), v.float(), causal=causal, return_lse=True)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def test_attention_return_lse_gives_fp32_lse_and_the_same_output():
    q, k, v = _qkv((1, 4, 2, 9, 16), torch.bfloat16)
    out, lse = attention(q, k, v, return_lse=True, scale=0.3)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 9)
    plain = attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_causal_attention_first_query_returns_first_value():
    q, k, v = _qkv((1, 2, 2, 5, 4), torch.float32)
    out = attention(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])


def test_attention_rejects_heads_not_divisible():
    q = torch.randn(1, 3, 4, 8)
    kv = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        attention(q, kv, kv)
