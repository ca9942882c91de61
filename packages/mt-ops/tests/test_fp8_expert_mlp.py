"""Fused FP8 SwiGLU expert MLP. Legend: R rows, D model dim, F hidden, E experts."""

import pytest
import torch
from torch import nn

from mt_ops import GroupedLinear, WeightGradQueue
from mt_ops.fp8_expert_mlp import fp8_swiglu_experts, fp8_swiglu_experts_reference
from mt_ops.fp8_linear import FP8GroupedLinear, FP8WeightCache


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.detach().double(), y.detach().double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _projections(num_experts, dim, hidden, device="cpu", cache=None, backend=None):
    torch.manual_seed(0)
    projs = []
    for d_in, d_out in ((dim, hidden), (dim, hidden), (hidden, dim)):
        module = GroupedLinear(num_experts, d_in, d_out).to(device)
        nn.init.normal_(module.weight, std=d_in**-0.5)
        projs.append(
            FP8GroupedLinear.from_grouped_linear(module, weight_cache=cache, backend=backend)
        )
    return projs


def _run(fn, x, counts, grad, projs):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, counts, *projs)
    y.backward(grad)
    return y.detach(), x.grad, [m.weight.grad for m in projs]


def test_fused_mlp_matches_unfused_modules_and_fp32_on_cpu():
    counts = torch.tensor([100, 0, 37, 200])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(337, 256, generator=gen).bfloat16()
    grad = torch.randn(337, 256, generator=gen).bfloat16()
    fused = _run(fp8_swiglu_experts, x, counts, grad, _projections(4, 256, 384))
    unfused = _run(fp8_swiglu_experts_reference, x, counts, grad, _projections(4, 256, 384))
    # The unfused CPU path rounds silu(gate) to bf16 before multiplying by up; fused rounds once.
    for got, ref in zip([fused[0], fused[1], *fused[2]], [unfused[0], unfused[1], *unfused[2]],
                        strict=True):  # fmt: skip
        assert _relative(got, ref) <= 3e-2
    assert torch.all(fused[2][0][1] == 0) and torch.all(fused[2][2][1] == 0)  # no rows: no grad
    # Against the exact fp32 MLP.
    projs = _projections(4, 256, 384)
    weights = [m.weight.detach().clone().requires_grad_(True) for m in projs]
    x32 = x.float().requires_grad_(True)
    pieces = []
    for e, x_e in enumerate(torch.split(x32, counts.tolist())):
        h = torch.nn.functional.silu(x_e @ weights[0][e].T) * (x_e @ weights[1][e].T)
        pieces.append(h @ weights[2][e].T)
    torch.cat(pieces).backward(grad.float())
    # Three chained FP8 products (x, h and dy quantized on the way): each adds ~1e-3 of
    # calc_diff, so the MLP is held to 3e-3, as tight as the unfused modules reach.
    exact = [torch.cat(pieces), x32.grad, *[w.grad for w in weights]]
    for got, want in zip([fused[0], fused[1], *fused[2]], exact, strict=True):
        assert calc_diff(got, want) <= 3e-3


def test_fused_mlp_defers_weight_grads_into_each_projections_queue():
    counts = torch.tensor([30, 50])
    x, grad = torch.randn(80, 128).bfloat16(), torch.randn(80, 128).bfloat16()
    immediate = _run(fp8_swiglu_experts, x, counts, grad, _projections(2, 128, 256))
    projs = _projections(2, 128, 256)
    queue = WeightGradQueue()
    for m in projs:
        m.wgrad_queue = queue
    deferred = _run(fp8_swiglu_experts, x, counts, grad, projs)
    assert all(g is None for g in deferred[2]) and len(queue) == 3
    queue.flush()
    assert torch.equal(deferred[1], immediate[1])
    for m, g in zip(projs, immediate[2], strict=True):
        assert torch.equal(m.weight.grad, g)


def test_fused_mlp_under_autograd_grad_returns_the_asked_weight_grads_and_queues_none():
    counts = torch.tensor([30, 50])
    x, grad = torch.randn(80, 128), torch.randn(80, 128)
    immediate = _run(fp8_swiglu_experts, x, counts, grad, _projections(2, 128, 256))
    projs = _projections(2, 128, 256)
    queue = WeightGradQueue()
    for m in projs:
        m.wgrad_queue = queue
    y = fp8_swiglu_experts(x, counts, *projs)
    # gate and down asked for, up left out: up's gradient is neither returned nor queued.
    got = torch.autograd.grad(y, [projs[0].weight, projs[2].weight], grad)
    for g, want in zip(got, (immediate[2][0], immediate[2][2]), strict=True):
        assert torch.equal(g, want)
    assert len(queue) == 0 and all(m.weight.grad is None for m in projs)


def test_fused_mlp_quantizes_weights_once_per_step_through_the_cache():
    cache = FP8WeightCache()
    projs = _projections(2, 128, 256, cache=cache)
    x, counts = torch.randn(40, 128), torch.tensor([10, 30])
    fp8_swiglu_experts(x, counts, *projs)
    fp8_swiglu_experts(x, counts, *projs)
    assert cache.num_quantizations == 3


def test_fused_mlp_rejects_biased_or_misordered_projections():
    projs = _projections(2, 128, 256)
    x, counts = torch.randn(4, 128), torch.tensor([2, 2])
    with pytest.raises(ValueError, match="gate/up"):
        fp8_swiglu_experts(x, counts, projs[0], projs[2], projs[1])
    biased = FP8GroupedLinear(2, 128, 256, bias=True)
    with pytest.raises(ValueError, match="without bias"):
        fp8_swiglu_experts(x, counts, biased, projs[1], projs[2])
    # Float counts were truncated by the fused op (the reference refused them).
    for fn in (fp8_swiglu_experts, fp8_swiglu_experts_reference):
        with pytest.raises(ValueError, match=r"tokens_per_expert dtype \(torch.float32\)"):
            fn(x, counts.float(), *projs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("counts", [[700, 0, 300, 1, 1047], [1024] * 4])
def test_gpu_fused_mlp_equals_unfused_modules_bit_for_bit_except_input_grad_rounding(counts):
    counts_E = torch.tensor(counts, device="cuda")
    rows = sum(counts)
    x = torch.randn(rows, 2048, device="cuda").bfloat16()
    grad = torch.randn(rows, 2048, device="cuda").bfloat16()
    fused = _run(
        fp8_swiglu_experts, x, counts_E, grad,
        _projections(len(counts), 2048, 768, "cuda", FP8WeightCache(), "triton"),
    )  # fmt: skip
    unfused = _run(
        fp8_swiglu_experts_reference, x, counts_E, grad,
        _projections(len(counts), 2048, 768, "cuda", FP8WeightCache(), "triton"),
    )  # fmt: skip
    assert torch.equal(fused[0], unfused[0])
    for got, ref in zip(fused[2], unfused[2], strict=True):
        assert torch.equal(got, ref)
    assert _relative(fused[1], unfused[1]) <= 4e-3  # one bf16 rounding instead of two


def test_grouped_swiglu_mlp_runs_the_fused_op_only_for_bias_free_fp8_projections():
    from mt_ops import grouped_swiglu_mlp, swiglu

    counts = torch.tensor([5, 0, 11])
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    fp8 = _projections(3, 128, 256)
    assert torch.equal(grouped_swiglu_mlp(x, counts, *fp8), fp8_swiglu_experts(x, counts, *fp8))
    plain = [GroupedLinear(3, 128, 256), GroupedLinear(3, 128, 256), GroupedLinear(3, 256, 128)]
    for module in plain:
        nn.init.normal_(module.weight, std=0.05)
    composed = plain[2](swiglu(plain[0](x, counts), plain[1](x, counts)), counts)
    assert torch.equal(grouped_swiglu_mlp(x, counts, *plain), composed)
    biased = []
    for d_in, d_out in ((128, 256), (128, 256), (256, 128)):
        module = GroupedLinear(3, d_in, d_out, bias=True)
        nn.init.normal_(module.weight, std=0.05)
        nn.init.normal_(module.bias, std=0.05)
        biased.append(FP8GroupedLinear.from_grouped_linear(module))
    composed = biased[2](swiglu(biased[0](x, counts), biased[1](x, counts)), counts)
    assert torch.equal(grouped_swiglu_mlp(x, counts, *biased), composed)


def test_fused_mlp_rejects_a_weight_cache_of_another_scale_format():
    projs = []
    for d_in, d_out in ((128, 256), (128, 256), (256, 128)):
        module = GroupedLinear(2, d_in, d_out)
        nn.init.normal_(module.weight, std=0.05)
        projs.append(FP8GroupedLinear.from_grouped_linear(
            module, weight_cache=FP8WeightCache("fp32"), scale_format="e8m0"
        ))  # fmt: skip
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match="weight cache scale_format .'fp32'. must equal"):
        fp8_swiglu_experts(x, torch.tensor([3, 5]), *projs)


def _moe_inputs(num_tokens, topk, num_experts, dim, device="cpu", dtype=torch.float32, seed=3):
    from mt_ops import plan_dispatch

    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, 1] = -1  # expert 1 gets no tokens
    topk_ids = scores.topk(topk, dim=-1).indices.to(device)
    x = torch.randn(num_tokens, dim, generator=gen).to(device, dtype)
    weights = torch.rand(num_tokens, topk, generator=gen).to(device)
    grad = torch.randn(num_tokens, dim, generator=gen).to(device, dtype)
    return plan_dispatch(topk_ids, num_experts), x, weights, grad


def _run_moe(fn, x, plan, weights, grad, projs):
    x = x.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    out = fn(x, plan, weights, *projs)
    out.backward(grad)
    return [out.detach(), x.grad, weights.grad, *[m.weight.grad for m in projs]]


def _composed_moe(x, plan, weights, *projs):
    from mt_ops import permute, unpermute

    rows = permute(x, plan)
    return unpermute(fp8_swiglu_experts(rows, plan.tokens_per_expert_E, *projs), plan, weights)


def test_fused_moe_block_matches_permute_mlp_unpermute_in_interpreter():
    # The fused autograd function on CPU tensors: its gather-sum and weight-gradient kernels
    # run in Triton's interpreter, the quantizations and GEMMs as their references (fp32:
    # the interpreter mis-rounds casts to bf16).
    from mt_ops.fp8_expert_mlp import _FP8MoESwiGLUFn, _Projections

    plan, x, weights, grad = _moe_inputs(150, 3, 4, 256)

    def fused(x, plan, weights, *projs):
        return _FP8MoESwiGLUFn.apply(
            x, weights, *(m.weight for m in projs), plan, _Projections(*projs)
        )

    got = _run_moe(fused, x, plan, weights, grad, _projections(4, 256, 384))
    want = _run_moe(_composed_moe, x, plan, weights, grad, _projections(4, 256, 384))
    names = ["out", "x grad", "weights grad", "gate grad", "up grad", "down grad"]
    for name, g, w in zip(names, got, want, strict=True):
        assert _relative(g, w) <= 1e-5, name  # fp32 sums in another order
    assert torch.all(got[4][1] == 0)  # expert 1 had no rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_moe_block_equals_permute_mlp_unpermute_bit_for_bit():
    from mt_ops import fp8_moe_swiglu_experts

    plan, x, weights, grad = _moe_inputs(2000, 6, 8, 2048, "cuda", torch.bfloat16)
    got = _run_moe(
        fp8_moe_swiglu_experts, x, plan, weights, grad,
        _projections(8, 2048, 768, "cuda", FP8WeightCache(), "triton"),
    )  # fmt: skip
    want = _run_moe(
        _composed_moe, x, plan, weights, grad,
        _projections(8, 2048, 768, "cuda", FP8WeightCache(), "triton"),
    )  # fmt: skip
    names = ["out", "x grad", "weights grad", "gate grad", "up grad", "down grad"]
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.equal(g, w), (name, _relative(g, w))
    # fp32 tokens under autocast (one-GPU training): the gradient comes back in fp32.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _run_moe(
            fp8_moe_swiglu_experts, x.float(), plan, weights, grad,
            _projections(8, 2048, 768, "cuda", FP8WeightCache(), "triton"),
        )  # fmt: skip
        want = _run_moe(
            _composed_moe, x.float(), plan, weights, grad,
            _projections(8, 2048, 768, "cuda", FP8WeightCache(), "triton"),
        )  # fmt: skip
    assert got[1].dtype == torch.float32
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.equal(g, w), ("autocast", name, _relative(g, w))


def test_grouped_swiglu_moe_fuses_only_bias_free_fp8_projections_and_checks_shapes(
    monkeypatch,
):
    import mt_ops.fp8_expert_mlp as fused_module
    from mt_ops import grouped_swiglu_moe, permute, swiglu, unpermute
    from mt_ops.fp8_expert_mlp import fp8_moe_swiglu_experts

    plan, x, weights, _ = _moe_inputs(40, 2, 3, 128)
    fp8 = _projections(3, 128, 256)
    fused_calls = []
    monkeypatch.setattr(
        fused_module,
        "fp8_moe_swiglu_experts",
        lambda *args: fused_calls.append(args) or fp8_moe_swiglu_experts(*args),
    )
    got = grouped_swiglu_moe(x, plan, weights, *fp8)
    assert len(fused_calls) == 1  # bias-free FP8 projections take the fused op
    assert torch.equal(got, _composed_moe(x, plan, weights, *fp8))  # which composes on CPU
    plain = [GroupedLinear(3, 128, 256), GroupedLinear(3, 128, 256), GroupedLinear(3, 256, 128)]
    for module in plain:
        nn.init.normal_(module.weight, std=0.05)
    counts = plan.tokens_per_expert_E
    rows = permute(x, plan)
    composed = plain[2](swiglu(plain[0](rows, counts), plain[1](rows, counts)), counts)
    assert torch.equal(grouped_swiglu_moe(x, plan, weights, *plain),
                       unpermute(composed, plan, weights))  # fmt: skip
    assert len(fused_calls) == 1  # BF16 modules: composed
    with pytest.raises(ValueError, match=r"x shape \(\(39, 128\)\).*T = 40, K = 2"):
        fp8_moe_swiglu_experts(x[:39], plan, weights[:39], *fp8)


@pytest.mark.parametrize("fn", [fp8_swiglu_experts, fp8_swiglu_experts_reference])
def test_fused_mlp_names_the_expert_with_a_negative_count(fn):
    # Before: "the row tiles' groups hold 13 rows but the result has 10" for counts that
    # do sum to the 10 rows.
    projs = _projections(3, 128, 256)
    with pytest.raises(ValueError, match=r"tokens_per_expert\[1\] is -3 .*\[12, -3, 1\]"):
        fn(torch.randn(10, 128), torch.tensor([12, -3, 1]), *projs)
