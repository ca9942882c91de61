"""Grouped linear. Legend: R routed rows, D input dim, O output dim, E experts."""

import pytest
import torch

from mt_ops import grouped_linear, grouped_linear_reference

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
