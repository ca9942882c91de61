"""Grouped linear. Legend: R routed rows, D input dim, O output dim, E experts."""

import importlib

import pytest
import torch

from mt_ops import GroupedLinear, grouped_linear, grouped_linear_reference
from mt_ops.grouped_linear import segment_sum

# (counts per expert, D, O): ragged with empty experts, dims not a multiple of any block,
# and no rows at all.
CASES = [([3, 0, 5, 1], 16, 24), ([0, 37, 0, 2, 11], 77, 33), ([0, 0, 0], 8, 8)]


def _inputs(counts, dim_in, dim_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_RD = torch.randn(sum(counts), dim_in, generator=gen).to(dtype)
    w_EOD = (torch.randn(len(counts), dim_out, dim_in, generator=gen) / dim_in**0.5).to(dtype)
    return x_RD, w_EOD, torch.tensor(counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_linear_matches_reference_forward_and_backward(
    case, dtype, assert_close, run_with_grads
):
    x_RD, w_EOD, counts_E = _inputs(*case, dtype)
    out, grads = run_with_grads(lambda x, w: grouped_linear(x, w, counts_E), [x_RD, w_EOD])
    ref, ref_grads = run_with_grads(
        lambda x, w: grouped_linear_reference(x, w, counts_E), [x_RD, w_EOD]
    )
    assert out.shape == (sum(case[0]), case[2]) and out.dtype == dtype
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(["x", "w"], grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


def test_grouped_linear_reference_matches_per_row_gathered_weights():
    counts = [4, 0, 6, 3]
    x_RD, w_EOD, counts_E = _inputs(counts, 13, 9, torch.float64)
    expert_of_row_R = torch.repeat_interleave(torch.arange(4), counts_E)
    expected_RO = torch.einsum("rd,rod->ro", x_RD, w_EOD[expert_of_row_R])
    torch.testing.assert_close(grouped_linear_reference(x_RD, w_EOD, counts_E), expected_RO)


def test_expert_with_no_rows_gets_zero_weight_gradient():
    x_RD, w_EOD, counts_E = _inputs([3, 0, 2], 8, 4, torch.float32)
    w_EOD.requires_grad_(True)
    grouped_linear(x_RD, w_EOD, counts_E).sum().backward()
    assert torch.all(w_EOD.grad[1] == 0) and w_EOD.grad[0].abs().sum() > 0


def test_grouped_linear_rejects_counts_not_summing_to_rows():
    x_RD, w_EOD, _ = _inputs([2, 2], 8, 4, torch.float32)
    with pytest.raises(ValueError, match="sums to 5"):
        grouped_linear(x_RD, w_EOD, torch.tensor([2, 3]))


@pytest.mark.parametrize("fn", [grouped_linear, grouped_linear_reference])
def test_host_counts_are_checked_once_for_a_forward_and_its_backward(fn, monkeypatch):
    # grouped_linear checked them five times (the entry check, the forward's split, then the
    # input gradient's and both weight-gradient splits in the backward); the reference twice.
    module = importlib.import_module("mt_ops.grouped_linear")  # mt_ops.grouped_linear: the op
    calls = []
    check_counts = module.check_counts

    def counting_check_counts(counts, num_rows):
        calls.append((counts, num_rows))
        check_counts(counts, num_rows)

    monkeypatch.setattr(module, "check_counts", counting_check_counts)
    x_RD, w_EOD, counts_E = _inputs([3, 0, 5, 1], 16, 24, torch.float32)
    x_RD.requires_grad_(True)
    w_EOD.requires_grad_(True)
    bias_EO = torch.randn(4, 24, requires_grad=True)
    fn(x_RD, w_EOD, counts_E, bias_EO).sum().backward()
    assert calls == [([3, 0, 5, 1], 9)]
    assert x_RD.grad.abs().sum() > 0 and w_EOD.grad[2].abs().sum() > 0


@pytest.mark.parametrize("count_dtype", [torch.int16, torch.uint8, torch.int32])
def test_small_integer_counts_with_bias_match_int64_counts_forward_and_backward(count_dtype):
    # Before, int16 / uint8 counts (integers, as the docstring asks) crashed in the bias's
    # repeat_interleave, which only takes int32 / int64.
    x_RD, w_EOD, counts_E = _inputs([3, 0, 5, 1], 6, 4, torch.float32)
    bias_EO = torch.randn(4, 4)
    params = [t.requires_grad_() for t in (x_RD, w_EOD, bias_EO)]
    out = grouped_linear(*params[:2], counts_E.to(count_dtype), params[2])
    grads = torch.autograd.grad(out.square().sum(), params)
    ref = grouped_linear_reference(*params[:2], counts_E, params[2])
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(out, ref)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg)


def test_fp64_bias_gradient_is_the_fp64_segmented_sum_not_rounded_to_fp32():
    # Before, segment_sum computed in fp32 whatever the dtype: fp64 bias gradients were
    # off by fp32 rounding (~1e-7 relative).
    x_RD, w_EOD, counts_E = _inputs([40, 0, 25, 7], 6, 4, torch.float64)
    bias_EO = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    dy_RO = torch.randn(72, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (grad_b,) = torch.autograd.grad(grouped_linear(x_RD, w_EOD, counts_E, bias_EO), bias_EO, dy_RO)
    want = torch.stack([part.sum(0) for part in dy_RO.split(counts_E.tolist())])
    torch.testing.assert_close(grad_b, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("count_dtype", [torch.int16, torch.uint8])
def test_segment_sum_takes_narrow_integer_counts(count_dtype):
    # Before: NotImplementedError from segment_reduce's lengths for Short / Byte.
    t_RO = torch.randn(7, 3)
    got = segment_sum(t_RO, torch.tensor([4, 0, 3], dtype=count_dtype))
    want = torch.stack([t_RO[:4].sum(0), torch.zeros(3), t_RO[4:].sum(0)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [grouped_linear, grouped_linear_reference])
def test_float_or_negative_counts_are_rejected_by_name(fn):
    # Before: a TypeError from split_with_sizes (float) and a RuntimeError naming
    # split_sizes (negative), neither naming tokens_per_expert.
    x_RD, w_EOD, _ = _inputs([3, 0, 5, 1], 6, 4, torch.float32)
    with pytest.raises(ValueError, match=r"tokens_per_expert dtype \(torch.float32\)"):
        fn(x_RD, w_EOD, torch.tensor([3.0, 0.0, 5.0, 1.0]))
    with pytest.raises(ValueError, match=r"tokens_per_expert\[1\] is -1 .*\[10, -1, 0, 0\]"):
        fn(x_RD, w_EOD, torch.tensor([10, -1, 0, 0]))


@pytest.mark.parametrize("fn", [grouped_linear, grouped_linear_reference])
def test_x_or_bias_of_another_dtype_than_w_is_rejected_outside_autocast(fn):
    x_RD, w_EOD, counts_E = _inputs([3, 0, 2], 8, 4, torch.float32)
    bias_EO = torch.zeros(3, 4)
    with pytest.raises(
        ValueError,
        match=r"x dtype \(torch.bfloat16\) must equal w dtype \(torch.float32\) outside "
        r"autocast; pass x.to\(w.dtype\), or call under torch.autocast\('cpu'\)",
    ):
        fn(x_RD.bfloat16(), w_EOD, counts_E)
    with pytest.raises(ValueError, match=r"bias dtype \(torch.bfloat16\) must equal w dtype"):
        fn(x_RD, w_EOD, counts_E, bias_EO.bfloat16())
    with pytest.raises(ValueError, match=r"bias shape \(\(3, 5\)\) must be \[E, O\] = \(3, 4\)"):
        fn(x_RD, w_EOD, counts_E, torch.zeros(3, 5))


def test_grouped_linear_module_rejects_bf16_rows_for_fp32_weights_outside_autocast():
    module = GroupedLinear(3, 8, 4)
    with pytest.raises(ValueError, match=r"x dtype \(torch.bfloat16\) must equal w dtype"):
        module(torch.randn(5, 8, dtype=torch.bfloat16), torch.tensor([3, 0, 2]))


def test_bf16_rows_with_fp32_weights_and_bias_under_autocast_match_reference(
    assert_close, run_with_grads
):
    x_RD, w_EOD, counts_E = _inputs([5, 0, 9, 2], 16, 24, torch.float32)
    x_RD = x_RD.bfloat16()
    bias_EO = torch.randn(4, 24, generator=torch.Generator().manual_seed(1))

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_with_grads(lambda x, w, b: fn(x, w, counts_E, b), [x_RD, w_EOD, bias_EO])

    (y, grads), (ref_y, ref_grads) = run(grouped_linear), run(grouped_linear_reference)
    assert y.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    assert_close(y.float(), ref_y.float(), torch.bfloat16, "out")
    for name, g, rg in zip(["x", "w", "bias"], grads, ref_grads, strict=True):
        assert_close(g.float(), rg.float(), torch.bfloat16, f"grad {name}")


def test_reference_with_fp32_rows_and_bias_under_autocast_returns_the_autocast_dtype():
    # Before, the reference added the bias in x's dtype (fp32), promoting the bf16 product
    # back to fp32, while the op (and nn.Linear) return bf16.
    x_RD, w_EOD, counts_E = _inputs([5, 0, 9, 2], 16, 24, torch.float32)
    bias_EO = torch.randn(4, 24, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_linear_reference(x_RD, w_EOD, counts_E, bias_EO)
        want = grouped_linear(x_RD, w_EOD, counts_E, bias_EO)
        linear = torch.nn.functional.linear(x_RD[:5], w_EOD[0], bias_EO[0])
    assert got.dtype == want.dtype == linear.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_path_matches_reference_on_cuda(assert_close, run_with_grads):
    x_RD, w_EOD, counts_E = _inputs([64, 0, 40, 24], 128, 256, torch.bfloat16)
    x_RD, w_EOD, counts_E = x_RD.cuda(), w_EOD.cuda(), counts_E.cuda()
    out, grads = run_with_grads(lambda x, w: grouped_linear(x, w, counts_E), [x_RD, w_EOD])
    ref, ref_grads = run_with_grads(
        lambda x, w: grouped_linear_reference(x, w, counts_E), [x_RD, w_EOD]
    )
    assert_close(out, ref, torch.bfloat16, "out")
    for name, g, rg in zip(["x", "w"], grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, f"grad {name}")
