import math

import pytest
import torch

from mt_ops import apply_sinks, attention, attention_reference

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


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("fn", [attention, attention_reference])
def test_q_k_v_of_different_dtypes_are_rejected_outside_autocast(fn, return_lse):
    # Before, the reference (and the op's LSE route on CPU) upcast the mix; SDPA refused it.
    q, k, v = _qkv((1, 4, 2, 5, 16), torch.float32)
    with pytest.raises(
        ValueError,
        match=r"v dtype \(torch.bfloat16\) must equal q dtype \(torch.float32\) outside "
        r"autocast; pass v.to\(q.dtype\), or call under torch.autocast\('cpu'\)",
    ):
        fn(q, k, v.bfloat16(), return_lse=return_lse)
    with pytest.raises(ValueError, match=r"k dtype \(torch.float32\) must equal q dtype"):
        fn(q.bfloat16(), k, v, return_lse=return_lse)


@pytest.mark.parametrize("kwargs", [{}, {"window": 3}, {"return_lse": True}])
def test_fp32_q_k_with_bf16_v_under_autocast_match_reference(kwargs, assert_close):
    # Under autocast SDPA casts all three to bf16; the reference computes in fp32 anyway.
    q, k, v = _qkv((1, 4, 2, 9, 16), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v.bfloat16(), **kwargs)
        ref = attention_reference(q, k, v.bfloat16(), **kwargs)
    if kwargs.get("return_lse"):
        (out, lse), (ref, ref_lse) = out, ref
        assert_close(lse, ref_lse, torch.bfloat16, "lse")
    assert_close(out.float(), ref.float(), torch.bfloat16, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_and_lse_under_autocast_give_the_fp32_lse_and_output_of_the_call_outside(dtype):
    # On CPU these run the reference, which is documented to compute in fp32 and return an
    # fp32 LSE (what flex returns on CUDA, where autocast has no rule for it). Before, its
    # matmuls were autocast to BF16 there: a BF16 LSE (~1e-2 off; merging chunks by LSE
    # loses precision) and BF16-rounded scores and probabilities behind the output.
    q, k, v = _qkv((1, 4, 2, 9, 16), dtype, seed=2)
    sinks = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    for kwargs in ({"return_lse": True}, {"sinks": sinks, "return_lse": True}, {"sinks": sinks}):
        expected = attention(q, k, v, window=4, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = attention(q, k, v, window=4, **kwargs)
            ref = attention_reference(q, k, v, window=4, **kwargs)
        for result in (got, ref):
            if kwargs.get("return_lse"):
                assert result[1].dtype == torch.float32 and torch.equal(result[1], expected[1])
                result, want = result[0], expected[0]
            else:
                want = expected
            assert result.dtype == dtype and torch.equal(result, want), kwargs
    meta = torch.empty(1, 4, 9, 16, device="meta")  # (devices without autocast still trace)
    assert attention_reference(meta, meta, meta, return_lse=True)[1].shape == (1, 4, 9)


def _float64_attention(q, k, v, mask, sinks=None, scale=None):
    """Softmax over [scores, sink] in float64, the sink column dropped (GPT-OSS's eager form)."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.double() @ kr.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ vr


@pytest.mark.parametrize("window", [1, 4, 100])
def test_sliding_window_matches_hugging_face_mask_kv_after_q_minus_window(window):
    q, k, v = _qkv((2, 4, 2, 11, 8), torch.float32)
    i, j = torch.arange(11)[:, None], torch.arange(11)[None]
    mask = (j <= i) & (j > i - window)  # transformers' sliding_window_overlay
    expected = _float64_attention(q, k, v, mask)
    for fn in (attention, attention_reference):
        out = fn(q, k, v, window=window)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_sinks_equal_an_extra_softmax_column_without_value():
    q, k, v = _qkv((2, 4, 2, 9, 8), torch.float32, seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = _float64_attention(q, k, v, mask, sinks)
    out = attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, attention(q, k, v), atol=1e-3)  # the sinks matter


def test_float64_attention_with_sinks_and_lse_is_computed_in_float64():
    # The reference (run on CPU for sinks and LSE requests) rounded fp64 through fp32:
    # ~1e-8 off and failing gradcheck.
    q, k, v = _qkv((1, 4, 2, 5, 3), torch.float64, seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)
    out, lse = attention(q, k, v, window=2, sinks=sinks, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, _float64_attention(q, k, v, mask, sinks), rtol=1e-12, atol=0)
    inputs = [t.requires_grad_(True) for t in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: attention_reference(q, k, v, window=2, sinks=s, return_lse=True),
        inputs,
    )


def test_sinks_apply_once_after_merging_two_key_chunks_by_lse():
    """What a ring-attention core does: partial (out, lse) per k chunk, merge, then sinks."""
    q, k, v = _qkv((1, 4, 2, 12, 8), torch.float32, seed=4)
    sinks = torch.tensor([0.3, -0.2, 1.0, 2.0])
    q_pos = torch.arange(6, 12)  # the second half of the queries
    parts = [
        attention(
            q[:, :, 6:],
            k[:, :, s],
            v[:, :, s],
            q_positions=q_pos,
            kv_positions=torch.arange(12)[s],
            window=5,
            return_lse=True,
        )
        for s in (slice(0, 6), slice(6, 12))
    ]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    merged = sum(out * torch.exp(part_lse - lse)[..., None] for out, part_lse in parts)
    got = apply_sinks(merged, lse, sinks)
    expected = attention(q, k, v, window=5, sinks=sinks)[:, :, 6:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_query_that_sees_no_key_gets_zero_output_and_minus_inf_lse_with_finite_grads():
    q, k, v = _qkv((1, 2, 2, 4, 8), torch.float32, seed=5)
    q.requires_grad_(True)
    out, lse = attention(
        q, k, v, q_positions=torch.arange(4), kv_positions=torch.arange(10, 14), return_lse=True
    )
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert torch.all(torch.isfinite(q.grad))


@pytest.mark.parametrize("window", [None, 3])
def test_lse_and_output_with_value_dim_different_from_query_dim(window):
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 4, 7, 12, generator=gen), torch.randn(2, 4, 7, 12, generator=gen)
    v = torch.randn(2, 4, 7, 5, generator=gen)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None]
    mask = (j <= i) & ((j > i - window) if window else True)
    out, lse = attention(q, k, v, window=window, scale=0.2, return_lse=True)
    assert out.shape == (2, 4, 7, 5)
    scores = (q.double() @ k.double().transpose(-2, -1) * 0.2).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        out.double(), _float64_attention(q, k, v, mask, scale=0.2), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(out, attention(q, k, v, window=window, scale=0.2))


def test_positions_shift_the_causal_mask_of_a_chunk_pair():
    """q chunk at global positions 4..7 against k chunk 0..7 equals rows 4..7 of the whole."""
    q, k, v = _qkv((1, 4, 2, 8, 8), torch.float32, seed=7)
    whole = attention_reference(q, k, v)
    chunk = attention(q[:, :, 4:], k, v, q_positions=torch.arange(4, 8))
    torch.testing.assert_close(chunk, whole[:, :, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_sinks_backward_match_reference(dtype, assert_close, run_with_grads):
    q, k, v = _qkv((1, 4, 2, 37, 24), dtype, seed=8)
    sinks = torch.linspace(-1, 1, 4)
    out, grads = run_with_grads(lambda *t: attention(*t, window=9, sinks=sinks), [q, k, v])
    ref, ref_grads = run_with_grads(
        lambda *t: attention_reference(*t, window=9, sinks=sinks), [q, k, v]
    )
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


def test_invalid_window_and_sinks_shape_are_rejected():
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="sinks shape"):
        attention(q, q, q, sinks=torch.zeros(3))


@pytest.mark.parametrize("fn", [attention, attention_reference])
@pytest.mark.parametrize(
    "name, value, message",
    [
        # Before, a batch of 3 against B=2 or a 3-D tensor failed in a broadcast with an
        # error naming neither argument, and float positions were truncated to integers.
        ("q_positions", torch.arange(4).expand(3, 4), r"q_positions shape \(\(3, 4\)\)"),
        ("kv_positions", torch.zeros(2, 1, 4, dtype=torch.long), r"kv_positions shape"),
        ("q_positions", torch.arange(4) + 0.5, r"q_positions dtype \(torch.float32\)"),
        ("document_ids", torch.zeros(3, 4, dtype=torch.long), r"q_document_ids shape"),
        ("document_ids", torch.zeros(4), r"q_document_ids dtype \(torch.float32\)"),
    ],
)
def test_positions_and_document_ids_of_wrong_batch_rank_or_dtype_are_rejected_by_name(
    fn, name, value, message
):
    q = torch.randn(2, 2, 4, 8)
    both = {"q_document_ids": value, "kv_document_ids": value}
    kwargs = both if name == "document_ids" else {name: value}
    with pytest.raises(ValueError, match=message):
        fn(q, q, q, **kwargs)


def test_document_ids_keep_attention_inside_each_packed_document():
    q, k, v = _qkv((2, 4, 2, 10, 8), torch.float32, seed=9)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 10])
    out = attention(q, k, v, q_document_ids=docs, kv_document_ids=docs, window=3)
    ref = attention_reference(q, k, v, q_document_ids=docs, kv_document_ids=docs, window=3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    alone = attention_reference(q[:1, :, 3:7], k[:1, :, 3:7], v[:1, :, 3:7], window=3)
    torch.testing.assert_close(out[:1, :, 3:7], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1:], attention(q[1:], k[1:], v[1:], window=3))
    with pytest.raises(ValueError, match="given together"):
        attention(q, k, v, q_document_ids=docs)


# The flex_attention path (sinks and LSE requests on CUDA), run eagerly on CPU: its block
# mask must apply the reference's rules (causal, window, chunk positions, documents, a
# query that sees no key) and its output and LSE must be the reference's. Flex has no
# backward on CPU; the GPU test checks the q/k/v gradients, this one the sinks' gradient.
FLEX_CASES = {
    "causal GQA": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(window=5),
    "chunk positions, queries with no key": dict(
        q_positions=torch.arange(20) + 12, kv_positions=torch.arange(20) + 4, window=6
    ),
    "documents": dict(
        q_document_ids=torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 20]),
        kv_document_ids=torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 20]),
        window=4,
    ),
}


def flex_options(rules):
    names = ("q_positions", "kv_positions", "q_document_ids", "kv_document_ids", "window")
    return {**dict.fromkeys(names), "causal": True, "scale": 0.3, **rules}


@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_flex_path_equals_reference_output_lse_and_sink_gradients(name):
    from mt_ops.attention import _flex_attention_lse, _with_sinks

    q, k, v = _qkv((2, 4, 2, 20, 16), torch.float32, seed=11)
    options = flex_options(FLEX_CASES[name])
    sinks = torch.tensor([-1.0, 0.0, 0.5, 2.0], requires_grad=True)
    ref_sinks = sinks.detach().clone().requires_grad_(True)
    out, lse = _flex_attention_lse(q, k, v, compiled=False, **options)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if "no key" in name:
        assert bool(torch.isneginf(lse).any())  # the case does have queries without keys
    out, lse = _with_sinks(out, lse, sinks)
    ref, ref_lse = attention_reference(q, k, v, sinks=ref_sinks, return_lse=True, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(ref)
    ((out * weights).sum() + lse.sum()).backward()
    ((ref * weights).sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(sinks.grad, ref_sinks.grad, rtol=1e-4, atol=1e-5)


def test_flex_block_mask_of_index_rules_is_built_once_per_shape():
    from mt_ops.attention import _flex_attention_lse, _index_block_mask

    q, k, v = _qkv((2, 4, 2, 20, 16), torch.float32, seed=3)
    _index_block_mask.cache_clear()
    for batch in (2, 1, 2):  # the mask has batch 1 and broadcasts
        out, _ = _flex_attention_lse(
            q[:batch], k[:batch], v[:batch], compiled=False, **flex_options({"window": 5})
        )
        expected = attention_reference(q[:batch], k[:batch], v[:batch], window=5, scale=0.3)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    info = _index_block_mask.cache_info()
    assert (info.misses, info.hits) == (1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sinks_and_lse_take_compiled_flex_and_match_reference_with_gradients():
    import torch._dynamo.utils

    from mt_ops.attention import _flex_supported

    def check(name, seed):
        options = flex_options(FLEX_CASES[name])
        options = {key: t.cuda() if isinstance(t, torch.Tensor) else t
                   for key, t in options.items()}  # fmt: skip
        q, k, v = (t.cuda() for t in _qkv((2, 8, 2, 20, 64), torch.bfloat16, seed=seed))
        sinks = torch.linspace(-1, 2, 8, device="cuda")
        assert _flex_supported(q, v)
        results = []
        for run in (attention, attention_reference):
            inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
            sink = sinks.clone().requires_grad_(True)
            out, lse = run(*inputs, sinks=sink, return_lse=True, **options)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).cuda()
            ((out.float() * weights).sum() + lse.sum()).backward()
            results.append([out.float(), lse, *(t.grad.float() for t in (*inputs, sink))])
        for got, expected in zip(*results, strict=True):
            rel = float((got - expected).norm() / expected.norm().clamp_min(1e-12))
            assert rel <= 1e-2, (name, rel)  # bf16 inputs and outputs (reference in fp32)

    # Causal window on indices (the cached mask), window + chunk positions + queries
    # without keys, and packed documents.
    for name in ("window", "chunk positions, queries with no key", "documents"):
        check(name, seed=12)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    check("documents", seed=13)  # new data, same rules: no recompilation
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_masks_without_sinks_match_reference_through_flex_and_sdpa(monkeypatch):
    from mt_ops.attention import FLEX

    # The default (windows and documents to flex), everything to flex, SDPA's boolean mask.
    for masks in ("auto", "all", "none"):
        monkeypatch.setitem(FLEX, "masks", masks)
        for name in ("window", "chunk positions, queries with no key", "documents"):
            options = {key: t.cuda() if isinstance(t, torch.Tensor) else t
                       for key, t in flex_options(FLEX_CASES[name]).items()}  # fmt: skip
            q, k, v = (t.cuda() for t in _qkv((2, 8, 2, 20, 64), torch.bfloat16, seed=5))
            results = []
            for run in (attention, attention_reference):
                inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out = run(*inputs, **options)
                weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
                (out.float() * weights.cuda()).sum().backward()
                results.append([out.float(), *(t.grad.float() for t in inputs)])
            for got, expected in zip(*results, strict=True):
                rel = float((got - expected).norm() / expected.norm().clamp_min(1e-12))
                assert rel <= 1e-2, (masks, name, rel)  # bf16 against the fp32 reference
    # Packed documents over several blocks (whole, partial and empty ones; 700 tokens).
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor([130, 256, 5, 309])).cuda()
    q, k, v = (t.cuda() for t in _qkv((1, 8, 2, 700, 64), torch.bfloat16, seed=6))
    options = {"q_document_ids": docs, "kv_document_ids": docs}
    results = []
    for run in (attention, attention_reference):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = run(*inputs, **options)
        (out.float() * torch.linspace(-1, 1, 64, device="cuda")).sum().backward()
        results.append([out.float(), *(t.grad.float() for t in inputs)])
    for got, expected in zip(*results, strict=True):
        assert float((got - expected).norm() / expected.norm()) <= 1e-2


def test_a_window_that_is_not_an_int_is_refused_naming_it():
    q, k, v = _qkv((1, 2, 1, 8, 16), torch.float32, seed=0)
    for window in (2.5, 3.0, True):
        for run in (attention, attention_reference):
            with pytest.raises(ValueError, match=rf"window \({window!r}\) must be an int"):
                run(q, k, v, window=window)
    torch.testing.assert_close(attention(q, k, v, window=3), attention_reference(q, k, v, window=3))


@pytest.mark.parametrize("fn", [attention, attention_reference])
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_is_refused_naming_it(fn, scale):
    # Before: NaN or inf outputs from the reference, while SDPA on CPU returned the
    # default-scale result for NaN: op and reference disagreed without an error.
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=rf"scale \({scale}\) must be a finite number"):
        fn(q, q, q, causal=True, scale=scale)


def test_unknown_mask_route_is_refused(monkeypatch):
    from mt_ops.attention import FLEX

    monkeypatch.setitem(FLEX, "masks", "sometimes")
    q, k, v = _qkv((1, 2, 1, 8, 16), torch.float32, seed=0)
    with pytest.raises(ValueError, match="FLEX\\['masks'\\].*'sometimes'.*auto"):
        attention(q, k, v, window=3)


def _blocks(num_BHQ, indices_BHQK):
    """Dense [B, H, QB, KB] bool of the listed blocks of a BlockMask's (num, indices)."""
    listed = torch.arange(indices_BHQK.shape[-1]) < num_BHQ[..., None]
    dense = torch.zeros(indices_BHQK.shape, dtype=torch.bool)
    return dense.scatter(-1, indices_BHQK.long(), listed)


def _rows(*lengths):
    """Document ids [B, S] of packed rows, one list of document lengths per row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n))
                        for n in lengths])  # fmt: skip


DOCUMENT_MASK_CASES = {
    # causal, window, q ids, kv ids (None: the q ids); 700 tokens = 6 blocks, the last short.
    "packed rows, causal": (True, None, _rows([130, 256, 5, 309], [700]), None),
    "packed rows, window 300": (True, 300, _rows([130, 256, 5, 309], [700]), None),
    "packed rows, window only": (False, 300, _rows([400, 300]), None),
    "non-causal, fewer keys": (False, None, _rows([300, 400]), _rows([100, 150, 50])),
    "non-monotonic ids": (True, None, torch.tensor([[0, 2] * 64 + [1] * 128 + [0] * 444]), None),
}


@pytest.mark.parametrize("name", list(DOCUMENT_MASK_CASES))
def test_document_block_mask_has_create_block_masks_full_blocks_and_is_exact(name):
    from mt_ops.attention import _block_mask, _document_block_mask, _flex_attention_lse

    causal, window, q_docs, kv_docs = DOCUMENT_MASK_CASES[name]
    self_attention = kv_docs is None
    kv_docs = q_docs if self_attention else kv_docs
    batch, seq_q, seq_k = max(q_docs.shape[0], kv_docs.shape[0]), q_docs.shape[1], kv_docs.shape[1]
    args = (causal, window, batch, seq_q, seq_k, torch.device("cpu"))
    ours = _document_block_mask(*args, q_docs, kv_docs)
    theirs = _block_mask(*args, None, None, q_docs, kv_docs)
    ours_full = _blocks(ours.full_kv_num_blocks, ours.full_kv_indices)
    theirs_full = _blocks(theirs.full_kv_num_blocks, theirs.full_kv_indices)
    assert torch.equal(ours_full, theirs_full)  # the kernel skips the rules only there
    ours_some = _blocks(ours.kv_num_blocks, ours.kv_indices) | ours_full
    theirs_some = _blocks(theirs.kv_num_blocks, theirs.kv_indices) | theirs_full
    assert torch.all(ours_some >= theirs_some)  # no visible block left out
    if self_attention and name.startswith("packed"):  # sorted self-attention: exact
        assert torch.equal(ours_some, theirs_some)
        assert int(ours.full_kv_num_blocks.sum()) > 0
    q, k, v = _qkv((batch, 2, 1, max(seq_q, seq_k), 16), torch.float32, seed=9)
    q, k, v = q[:, :, :seq_q], k[:, :, :seq_k], v[:, :, :seq_k]
    options = {**flex_options({"window": window}), "causal": causal,
               "q_document_ids": q_docs, "kv_document_ids": kv_docs}  # fmt: skip
    out, lse = _flex_attention_lse(q, k, v, compiled=False, **options)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
