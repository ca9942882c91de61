"""FP8 linears, weight cache, conversion. Legend: R rows, D in, O out, E experts."""

import pytest
import torch
from torch import nn

from mt_ops import GroupedLinear, grouped_linear_reference
from mt_ops.deferred_wgrad import Linear, WeightGradQueue, set_weight_grad_queue
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear, FP8WeightCache, convert_to_fp8


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.detach().double(), y.detach().double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _grouped(num_experts=4, dim_in=256, dim_out=384, bias=True, device="cpu", seed=0):
    torch.manual_seed(seed)
    module = GroupedLinear(num_experts, dim_in, dim_out, bias=bias).to(device)
    nn.init.normal_(module.weight, std=dim_in**-0.5)
    if bias:
        nn.init.normal_(module.bias)
    return module


def _run(module, x, counts, grad_out):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, counts)
    y.backward(grad_out)
    return y, x.grad


@pytest.mark.parametrize("counts", [[100, 0, 37, 200], [0, 0, 5, 0]])
def test_fp8_grouped_linear_matches_fp32_within_calc_diff(counts):
    module = _grouped()
    counts_E = torch.tensor(counts)
    x = torch.randn(sum(counts), 256).bfloat16()
    fp8 = FP8GroupedLinear.from_grouped_linear(_grouped(), weight_cache=FP8WeightCache())
    grad_out = torch.randn(sum(counts), 384).bfloat16()
    y, grad_x = _run(fp8, x, counts_E, grad_out)
    assert y.dtype == torch.bfloat16 and fp8.weight.grad.dtype == torch.float32
    x_ref = x.float().requires_grad_(True)
    y_ref = grouped_linear_reference(x_ref, module.weight, counts_E, module.bias)
    y_ref.backward(grad_out.float())
    assert calc_diff(y, y_ref) <= 1e-3
    assert calc_diff(grad_x, x_ref.grad) <= 1e-3
    assert calc_diff(fp8.weight.grad, module.weight.grad) <= 1e-3
    # The bias gradient is an fp32 sum of the same bf16 grad_out rows (no FP8 on this path):
    # only the summation order may differ (measured: bit-equal; an fp32 sum of 200 rows
    # errs ~1e-5). The old 1e-2 passed a bias gradient rounded to bf16 (errors ~0.1).
    torch.testing.assert_close(fp8.bias.grad, module.bias.grad, rtol=1e-5, atol=1e-4)
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert torch.all(fp8.weight.grad[empty] == 0) and torch.all(fp8.bias.grad[empty] == 0)


def test_fp8_linear_matches_nn_linear_within_calc_diff_over_leading_dims():
    torch.manual_seed(1)
    linear = nn.Linear(128, 256)
    fp8 = FP8Linear.from_linear(nn.Linear(128, 256))
    fp8.load_state_dict(linear.state_dict())
    x = torch.randn(3, 50, 128).bfloat16()
    grad_out = torch.randn(3, 50, 256).bfloat16()
    x1 = x.clone().requires_grad_(True)
    y = fp8(x1)
    y.backward(grad_out)
    x2 = x.float().requires_grad_(True)
    y_ref = linear(x2)
    y_ref.backward(grad_out.float())
    assert y.shape == (3, 50, 256)
    assert calc_diff(y, y_ref) <= 1e-3 and calc_diff(x1.grad, x2.grad) <= 1e-3
    assert calc_diff(fp8.weight.grad, linear.weight.grad) <= 1e-3
    # An fp32 sum of the same bf16 grad_out rows, as above: summation order only.
    torch.testing.assert_close(fp8.bias.grad, linear.bias.grad, rtol=1e-5, atol=1e-4)


def test_weight_cache_quantizes_once_per_step_and_again_after_the_update():
    cache = FP8WeightCache()
    fp8 = FP8GroupedLinear.from_grouped_linear(_grouped(), weight_cache=cache)
    optimizer = torch.optim.SGD(fp8.parameters(), lr=0.1)
    counts = torch.tensor([10, 20, 0, 5])
    for _micro_batch in range(3):
        fp8(torch.randn(35, 256), counts).sum().backward()
    assert cache.num_quantizations == 1
    optimizer.step()
    cache.invalidate()
    assert len(cache) == 0
    y_after = fp8(torch.ones(35, 256), counts)
    assert cache.num_quantizations == 2
    optimizer.step()  # forgot invalidate(): the version guard still re-quantizes
    y_next = fp8(torch.ones(35, 256), counts)
    assert cache.num_quantizations == 3 and not torch.equal(y_after, y_next)
    dense = FP8Linear.from_linear(nn.Linear(128, 64), weight_cache=cache)
    for _micro_batch in range(2):
        dense(torch.randn(2, 5, 128)).sum().backward()
    assert cache.num_quantizations == 4  # a 2-D weight is cached by the parameter too


def test_convert_to_fp8_keeps_names_and_parameter_objects_and_skips_head_and_odd_dims():
    model = nn.Module()
    model.proj = nn.Linear(128, 256)
    model.odd = nn.Linear(100, 256)
    model.experts = nn.Module()
    model.experts.up_proj = _grouped()
    model.lm_head = nn.Linear(256, 512, bias=False)
    before = dict(model.named_parameters())
    convert_to_fp8(model, weight_cache=FP8WeightCache())
    after = dict(model.named_parameters())
    assert list(before) == list(after)
    assert all(before[name] is after[name] for name in before)
    assert isinstance(model.proj, FP8Linear) and isinstance(model.experts.up_proj, FP8GroupedLinear)
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    only_experts = nn.Module()
    only_experts.proj = nn.Linear(128, 256)
    only_experts.up = _grouped()
    convert_to_fp8(only_experts, lambda module, fqn: isinstance(module, GroupedLinear))
    assert type(only_experts.proj) is nn.Linear and isinstance(only_experts.up, FP8GroupedLinear)


def test_converted_experts_stay_grouped_linears_and_a_second_conversion_changes_nothing():
    # Code that finds expert projections by class (canonical per-expert checkpoint keys,
    # expert slicing) must still find them after conversion; meta models stay on meta.
    with torch.device("meta"):
        model = nn.Module()
        model.up_proj = GroupedLinear(4, 128, 256)
        model.proj = nn.Linear(128, 256)
    convert_to_fp8(model)
    converted = model.up_proj, model.proj
    assert isinstance(converted[0], GroupedLinear) and isinstance(converted[0], FP8GroupedLinear)
    assert all(p.is_meta for p in model.parameters())
    convert_to_fp8(model)
    assert model.up_proj is converted[0] and model.proj is converted[1]


def test_fp8_linears_take_the_zero_strided_gradient_of_an_empty_output():
    # y.sum() of an empty y sends back a gradient with strides (0, 0), which is "contiguous"
    # (no element), so .contiguous() keeps it: the quantizer must accept it, as nn.Linear does.
    linear = FP8Linear.from_linear(nn.Linear(32, 16))
    x = torch.randn(0, 32, requires_grad=True)
    linear(x).sum().backward()
    assert x.grad.shape == (0, 32) and torch.all(linear.weight.grad == 0)
    experts = FP8GroupedLinear.from_grouped_linear(_grouped(3, 32, 16))
    x = torch.randn(0, 32, requires_grad=True)
    experts(x, torch.zeros(3, dtype=torch.int64)).sum().backward()
    assert x.grad.shape == (0, 32) and torch.all(experts.weight.grad == 0)


def test_fp8_linears_reject_counts_and_features_that_do_not_fit_as_grouped_linear_does():
    # One count per expert: five counts for four experts would leave the fifth group's rows
    # unwritten (zeros here, uninitialized memory on GPU); four counts for five groups of
    # rows would run them through the wrong experts.
    experts = FP8GroupedLinear.from_grouped_linear(_grouped(4, 32, 16, bias=False))
    x = torch.randn(10, 32)
    for counts in ([2, 2, 2, 2, 2], [4, 3, 3]):
        with pytest.raises(ValueError, match=r"tokens_per_expert shape .* must be \[E\] = \[4\]"):
            experts(x, torch.tensor(counts))
    with pytest.raises(ValueError, match="must be .R, D. and .E, O, D."):
        experts(torch.randn(10, 48), torch.tensor([4, 3, 3, 0]))
    with pytest.raises(ValueError, match="sums to 12, not the 10 rows"):  # CPU: checked for free
        experts(x, torch.tensor([4, 4, 4, 0]))
    with pytest.raises(ValueError, match=r"x shape \(\(4, 64\)\) must end in in_features \(32\)"):
        FP8Linear.from_linear(nn.Linear(32, 16))(torch.randn(4, 64))


def test_fp8_grouped_linear_names_the_expert_with_a_negative_count_or_a_wrong_sum():
    module = FP8GroupedLinear.from_grouped_linear(_grouped(3, 128, 128))
    x_RD = torch.randn(10, 128)
    with pytest.raises(ValueError, match=r"tokens_per_expert\[1\] is -3 .*\[12, -3, 1\]"):
        module(x_RD, torch.tensor([12, -3, 1]))  # sums to the 10 rows
    with pytest.raises(ValueError, match=r"\(\[5, 1, 1\]\) sums to 7, not the 10 rows"):
        module(x_RD, torch.tensor([5, 1, 1]))


@pytest.mark.parametrize("count_dtype", [torch.int16, torch.uint8])
def test_fp8_grouped_linear_with_bias_takes_narrow_integer_counts(count_dtype):
    # Before, int16 / uint8 counts crashed the bias's repeat_interleave (and segment_sum,
    # the bias gradient), which take int32 / int64 only.
    experts = FP8GroupedLinear.from_grouped_linear(_grouped(3, 32, 16, bias=True))
    x = torch.randn(7, 32, requires_grad=True)
    counts = torch.tensor([4, 0, 3])
    out = experts(x, counts.to(count_dtype))
    grads = torch.autograd.grad(out.square().sum(), [x, experts.weight, experts.bias])
    want = experts(x, counts)
    want_grads = torch.autograd.grad(want.square().sum(), [x, experts.weight, experts.bias])
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_deferred_fp8_linear_weight_grad_lands_on_the_parameter():
    torch.manual_seed(5)
    immediate = FP8Linear.from_linear(nn.Linear(128, 64))
    deferred = FP8Linear.from_linear(nn.Linear(128, 64))
    deferred.load_state_dict(immediate.state_dict())
    queue = WeightGradQueue()
    set_weight_grad_queue(deferred, queue)
    x = torch.randn(3, 7, 128)
    for module in (immediate, deferred):
        module(x).square().sum().backward()
    assert deferred.weight.grad is None and queue.flush() == 1
    assert deferred.weight.grad.shape == (64, 128)
    torch.testing.assert_close(deferred.weight.grad, immediate.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_deferred_weight_grads_equal_immediate_ones(kind):
    counts = torch.tensor([7, 0, 30, 12])
    x = torch.randn(49, 256)
    grad_out = torch.randn(49, 384)

    def make():
        module = _grouped(seed=3)
        if kind == "fp8":
            module = FP8GroupedLinear.from_grouped_linear(module)
        return module

    immediate, deferred = make(), make()
    queue = WeightGradQueue()
    assert set_weight_grad_queue(deferred, queue) == 1
    for module in (immediate, deferred):
        module.weight.grad = torch.full_like(module.weight, 0.5)  # accumulates onto it
        _run(module, x, counts, grad_out)
    assert len(queue) == 1 and torch.all(deferred.weight.grad == 0.5)
    assert torch.equal(deferred.bias.grad, immediate.bias.grad)  # bias is not deferred
    assert queue.flush() == 1 and len(queue) == 0
    torch.testing.assert_close(deferred.weight.grad, immediate.weight.grad, rtol=0, atol=0)


def test_deferred_linear_equals_nn_linear():
    torch.manual_seed(4)
    reference = nn.Linear(24, 40)
    deferred = Linear.from_linear(nn.Linear(24, 40))
    deferred.load_state_dict(reference.state_dict())
    queue = WeightGradQueue()
    set_weight_grad_queue(deferred, queue)
    x = torch.randn(2, 9, 24)
    for module in (reference, deferred):
        x_leaf = x.clone().requires_grad_(True)
        module(x_leaf).square().sum().backward()
        module.x_grad = x_leaf.grad
    assert deferred.weight.grad is None and len(queue) == 1
    queue.flush()
    torch.testing.assert_close(deferred.weight.grad, reference.weight.grad)
    torch.testing.assert_close(deferred.bias.grad, reference.bias.grad)
    torch.testing.assert_close(deferred.x_grad, reference.x_grad)


def test_fp8_linear_rejects_unaligned_features():
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear(100, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_grouped_linear_on_gpu_matches_emulation_and_bf16(backend):
    counts = torch.tensor([0, 900, 17, 0, 2000, 1], device="cuda")
    module = _grouped(6, 2048, 768, bias=True, device="cuda")
    x = torch.randn(int(counts.sum()), 2048, device="cuda").bfloat16()
    grad_out = torch.randn(x.shape[0], 768, device="cuda").bfloat16()
    results = {}
    for name in (backend, "emulation"):
        fp8 = FP8GroupedLinear.from_grouped_linear(
            _grouped(6, 2048, 768, device="cuda"), backend=name
        )
        y, grad_x = _run(fp8, x, counts, grad_out)
        results[name] = (y.float(), grad_x.float(), fp8.weight.grad, fp8.bias.grad)
    names = ["y", "grad x", "grad w", "grad bias"]
    for name, got, expected in zip(names, results[backend], results["emulation"], strict=True):
        assert torch.isfinite(got).all(), name
        rel = float((got - expected).norm() / expected.norm())
        assert rel <= 4e-3, (name, rel)  # bf16 output rounding of the same fp32 products
    x_ref = x.float().requires_grad_(True)
    y_ref = grouped_linear_reference(x_ref, module.weight, counts, module.bias)
    y_ref.backward(grad_out.float())
    y, grad_x, grad_w, _ = results[backend]
    assert calc_diff(y, y_ref) <= 1e-3 and calc_diff(grad_x, x_ref.grad) <= 1e-3
    assert calc_diff(grad_w, module.weight.grad) <= 1e-3


def test_grouped_linear_and_deferred_linear_run_under_autocast_with_fp32_parameters():
    counts = torch.tensor([5, 0, 9, 2])
    module = _grouped(bias=True)
    linear = Linear.from_linear(nn.Linear(384, 32))
    queue = WeightGradQueue()
    set_weight_grad_queue(linear, queue)
    x = torch.randn(16, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(module(x, counts))
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    queue.flush()
    assert module.weight.grad.dtype == torch.float32 and linear.weight.grad.dtype == torch.float32
    assert module.weight.grad.abs().sum() > 0 and linear.weight.grad.abs().sum() > 0


def test_make_weight_grads_deferrable_swaps_linears_and_keeps_parameters():
    from mt_ops.deferred_wgrad import make_weight_grads_deferrable

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = dict(model.named_parameters())
    assert make_weight_grads_deferrable(model) == 2
    assert all(isinstance(model[i], Linear) for i in (0, 2))
    assert all(before[n] is p for n, p in model.named_parameters())


def test_model_swaps_refuse_a_root_layer_they_cannot_replace_in_place():
    # Both swap children in place; a model that is itself the layer came back unconverted
    # (convert_to_fp8 returned the nn.Linear, make_weight_grads_deferrable returned 0).
    from mt_ops.deferred_wgrad import make_weight_grads_deferrable

    linear = nn.Linear(128, 256)
    with pytest.raises(
        ValueError,
        match=r"model is itself a Linear \(in_features 128, out_features 256\), which "
        r"convert_to_fp8 cannot .*use FP8Linear\.from_linear\(model\)",
    ):
        convert_to_fp8(linear)
    with pytest.raises(ValueError, match=r"itself a GroupedLinear .*from_grouped_linear"):
        convert_to_fp8(_grouped())
    with pytest.raises(
        ValueError,
        match=r"model is itself a Linear .*make_weight_grads_deferrable cannot .*use "
        r"Linear\.from_linear\(model\)",
    ):
        make_weight_grads_deferrable(linear)
    assert type(linear) is nn.Linear
    # A root the filter leaves out, or one already converted, is no error.
    assert convert_to_fp8(linear, lambda module, fqn: False) is linear
    fp8 = FP8Linear.from_linear(linear)
    assert convert_to_fp8(fp8) is fp8
    assert make_weight_grads_deferrable(Linear.from_linear(nn.Linear(8, 8))) == 0


def test_convert_to_fp8_names_a_selected_layer_it_cannot_convert_and_changes_nothing():
    model = nn.Sequential(nn.Linear(128, 128), nn.Sequential(nn.Linear(128, 100)))
    with pytest.raises(
        ValueError, match=r"'1\.0' \(in_features 128, out_features 100\).*multiples of 16"
    ):
        convert_to_fp8(model, lambda module, fqn: True)
    assert type(model[0]) is nn.Linear  # refused before any swap: not half converted


def test_a_second_conversion_with_another_weight_cache_is_refused():
    # The caller would invalidate the new cache while the modules fill the old one, which
    # nobody invalidates: only the version guard (blind to fused AdamW) would catch updates.
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64))
    first = FP8WeightCache()
    convert_to_fp8(model, weight_cache=first)
    convert_to_fp8(model, weight_cache=first)  # same settings: nothing to do
    with pytest.raises(ValueError, match=r"'0' is already an FP8Linear with other settings"):
        convert_to_fp8(model, weight_cache=FP8WeightCache())
    with pytest.raises(ValueError, match=r"scale_format"):
        convert_to_fp8(model, weight_cache=first, scale_format="e8m0")
    assert model[0].weight_cache is first and model[0].scale_format == "fp32"


def test_weight_cache_requantizes_a_weight_converted_in_place():
    # module.to(dtype / device) replaces param.data: same Parameter, same version counter.
    cache = FP8WeightCache()
    fp8 = FP8Linear.from_linear(nn.Linear(128, 128, bias=False), weight_cache=cache)
    with torch.no_grad():
        # 1 + 2⁻⁴ + 2⁻⁹: E4M3 rounds it up; its bf16 rounding 1 + 2⁻⁴ is a tie, rounded down.
        fp8.weight.fill_(1 + 2**-4 + 2**-9)
    x = torch.randn(4, 128).bfloat16()
    fp8(x)
    fp8.bfloat16()
    y = fp8(x)
    assert cache.num_quantizations == 2
    uncached = FP8Linear.from_linear(fp8)  # the same (now bf16) parameter, no cache
    assert torch.equal(y, uncached(x))


def test_weight_cache_version_guard_misses_a_fused_adamw_step_so_invalidate_is_required():
    cache = FP8WeightCache()
    fp8 = FP8Linear.from_linear(nn.Linear(128, 128), weight_cache=cache)
    optimizer = torch.optim.AdamW(fp8.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 128)
    fp8(x).sum().backward()
    optimizer.step()  # the fused kernel leaves the version counter as it was
    assert cache.num_quantizations == 1
    stale = fp8(x)
    assert cache.num_quantizations == 1
    cache.invalidate()
    assert not torch.equal(fp8(x), stale) and cache.num_quantizations == 2


def test_fp8_linears_quantize_no_transposes_that_no_gradient_needs(monkeypatch):
    # xᵀ and dyᵀ feed only the weight gradient: evaluation (no_grad) and frozen weights
    # quantize by rows only, with the same results.
    import mt_ops.fp8_linear as fp8_linear

    dual_calls = []
    dual = fp8_linear.quantize_1x128_dual

    def counting_dual(*args, **kwargs):
        dual_calls.append(1)
        return dual(*args, **kwargs)

    monkeypatch.setattr(fp8_linear, "quantize_1x128_dual", counting_dual)
    counts = torch.tensor([10, 0, 25, 5])
    experts = FP8GroupedLinear.from_grouped_linear(_grouped(), weight_cache=FP8WeightCache())
    linear = FP8Linear.from_linear(nn.Linear(128, 64))
    x, x_dense = torch.randn(40, 256), torch.randn(3, 5, 128)
    y_train, y_dense_train = experts(x, counts), linear(x_dense)
    assert len(dual_calls) == 2
    with torch.no_grad():
        y_eval, y_dense_eval = experts(x, counts), linear(x_dense)
    assert len(dual_calls) == 2
    assert torch.equal(y_eval, y_train) and torch.equal(y_dense_eval, y_dense_train)
    grad_out = torch.randn(40, 384)
    _, grad_x = _run(experts, x, counts, grad_out)
    assert len(dual_calls) == 4  # forward and backward
    experts.weight.requires_grad_(False)
    experts.bias.requires_grad_(False)
    _, grad_x_frozen = _run(experts, x, counts, grad_out)
    assert len(dual_calls) == 4 and torch.equal(grad_x_frozen, grad_x)


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: FP8Linear(128, 64, **kw),
        lambda **kw: FP8GroupedLinear(2, 128, 64, **kw),
        lambda **kw: convert_to_fp8(nn.Sequential(nn.Linear(128, 64)), **kw),
    ],
)
def test_fp8_modules_refuse_an_unknown_backend_or_scale_format_when_built(build):
    # Before: accepted, and the first forward (after a whole model was converted) raised.
    with pytest.raises(ValueError, match=r"scale_format \('ue8m0'\) must be 'fp32'"):
        build(scale_format="ue8m0")
    with pytest.raises(ValueError, match=r"backend \('cublas'\) must be one of .*'emulation'"):
        build(backend="cublas")
    with pytest.raises(ValueError, match=r"scale_format \('ue8m0'\) must be 'fp32'"):
        FP8WeightCache(scale_format="ue8m0")
