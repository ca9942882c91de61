"""Routing plan and permutation. Legend: T tokens, D model dim, E experts, K top-k, R rows."""

import pytest
import torch

from mt_ops import permute, plan_dispatch, unpermute


def _routing(num_tokens, num_experts, topk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores_TE = torch.rand(num_tokens, num_experts, generator=gen)
    topk_ids_TK = scores_TE.topk(topk, dim=-1).indices
    weights_TK = torch.rand(num_tokens, topk, generator=gen)
    return topk_ids_TK, weights_TK / weights_TK.sum(-1, keepdim=True)


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_plan_counts_add_up_to_tokens_times_topk(num_tokens):
    topk_ids_TK, _ = _routing(num_tokens, num_experts=8, topk=3)
    plan = plan_dispatch(topk_ids_TK, num_experts=8)
    assert plan.tokens_per_expert_E.dtype == torch.int64
    assert plan.tokens_per_expert_E.shape == (8,)
    assert int(plan.tokens_per_expert_E.sum()) == num_tokens * 3
    assert plan.sorted_token_ids_R.shape == (num_tokens * 3,)


def test_plan_groups_rows_by_expert_and_is_stable_within_an_expert():
    topk_ids_TK, _ = _routing(29, num_experts=6, topk=2)
    plan = plan_dispatch(topk_ids_TK, num_experts=6)
    expert_of_row_R = topk_ids_TK.reshape(-1)[plan.sorted_slot_R]
    assert torch.all(expert_of_row_R[1:] >= expert_of_row_R[:-1])
    expected_expert_R = torch.repeat_interleave(torch.arange(6), plan.tokens_per_expert_E)
    assert torch.equal(expert_of_row_R, expected_expert_R)
    for e in range(6):
        tokens = plan.sorted_token_ids_R[expert_of_row_R == e]
        assert torch.all(tokens[1:] > tokens[:-1]), "token order kept within an expert"
    assert torch.equal(plan.sorted_token_ids_R, plan.sorted_slot_R // 2)
    assert torch.equal(plan.sorted_slot_R[plan.row_of_slot_R], torch.arange(58))


def test_experts_receiving_no_tokens_have_zero_count():
    topk_ids_TK = torch.tensor([[0, 5], [5, 0], [0, 5]])
    plan = plan_dispatch(topk_ids_TK, num_experts=8)
    assert plan.tokens_per_expert_E.tolist() == [3, 0, 0, 0, 0, 3, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 41])
def test_permute_then_unpermute_with_unit_weights_reproduces_x(num_tokens, dtype):
    topk_ids_TK, weights_TK = _routing(num_tokens, num_experts=7, topk=3)
    plan = plan_dispatch(topk_ids_TK, num_experts=7)
    x_TD = torch.randn(num_tokens, 33).to(dtype)
    x_RD = permute(x_TD, plan)
    assert x_RD.shape == (num_tokens * 3, 33)
    out_TD = unpermute(x_RD, plan, weights_TK)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out_TD, x_TD, rtol=tol, atol=tol)


def test_permute_expert_unpermute_matches_per_token_loop_in_value_and_gradient():
    num_tokens, num_experts, topk, dim = 23, 5, 2, 7
    topk_ids_TK, weights_TK = _routing(num_tokens, num_experts, topk, seed=3)
    scale_E = torch.arange(1.0, num_experts + 1)  # expert e multiplies by e + 1

    x1 = torch.randn(num_tokens, dim, requires_grad=True)
    w1 = weights_TK.clone().requires_grad_(True)
    plan = plan_dispatch(topk_ids_TK, num_experts)
    expert_of_row_R = torch.repeat_interleave(torch.arange(num_experts), plan.tokens_per_expert_E)
    y_RD = permute(x1, plan) * scale_E[expert_of_row_R, None]
    out = unpermute(y_RD, plan, w1)

    x2 = x1.detach().clone().requires_grad_(True)
    w2 = weights_TK.clone().requires_grad_(True)
    rows = [
        sum(w2[t, k] * scale_E[topk_ids_TK[t, k]] * x2[t] for k in range(topk))
        for t in range(num_tokens)
    ]
    expected = torch.stack(rows)
    torch.testing.assert_close(out, expected)

    grad_out = torch.randn(num_tokens, dim)
    out.backward(grad_out)
    expected.backward(grad_out)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_plan_rejects_expert_ids_out_of_range():
    with pytest.raises(ValueError, match="num_experts=4"):
        plan_dispatch(torch.tensor([[0, 4]]), num_experts=4)


def test_unpermute_rejects_wrong_row_count():
    plan = plan_dispatch(torch.tensor([[0, 1]]), num_experts=2)
    with pytest.raises(ValueError, match="R=2"):
        unpermute(torch.randn(3, 4), plan, torch.ones(1, 2))
