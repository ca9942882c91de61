"""Routing plan and permutation. Legend: T tokens, D model dim, E experts, K top-k, R rows."""

import dataclasses

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
    # Weights summing to one, so out = x·(1 ± a few fp32 ulps): fp32 keeps those ulps; in
    # bf16, x·(1 ± 1e-7) summed in fp32 rounds back to x itself, so exact. (1e-2 passed
    # an unpermute that multiplied and summed in bf16, not fp32 as it documents.)
    tol = 1e-6 if dtype == torch.float32 else 0.0
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


def test_plan_rejects_expert_ids_that_are_not_integers():
    # .long() would truncate router weights to ids 0 and 1 without a word.
    with pytest.raises(ValueError, match=r"topk_ids dtype \(torch.float32\) must be an integer"):
        plan_dispatch(torch.tensor([[0.7, 1.2]]), 3)


def test_unpermute_rejects_wrong_row_count():
    plan = plan_dispatch(torch.tensor([[0, 1]]), num_experts=2)
    with pytest.raises(ValueError, match="R=2"):
        unpermute(torch.randn(3, 4), plan, torch.ones(1, 2))


def test_unpermute_of_fp64_rows_is_computed_in_fp64():
    # Rounding through fp32 put the result ~1e-8 off, failing gradcheck.
    topk_ids_TK, weights_TK = _routing(5, 4, 2, seed=1)
    plan = plan_dispatch(topk_ids_TK, 4)
    y_RD = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    w_TK = weights_TK.double().requires_grad_(True)
    expected = y_RD[plan.row_of_slot_R].view(5, 2, 3).mul(w_TK[..., None]).sum(1)
    assert torch.equal(unpermute(y_RD, plan, w_TK), expected)
    assert torch.autograd.gradcheck(lambda y, w: unpermute(y, plan, w), (y_RD, w_TK))


# --- planning and permutation kernels (Triton interpreter on CPU, compiled on GPU) ------

from mt_ops.moe_permute import (  # noqa: E402
    _kernel_functions_for_test,
    permute_reference,
    unpermute_reference,
)
from mt_ops.moe_plan import (  # noqa: E402
    _kernels_apply,
    _run_plan_kernels_for_test,
    plan_dispatch_reference,
)

PLAN_FIELDS = ["tokens_per_expert_E", "sorted_token_ids_R", "sorted_slot_R", "row_of_slot_R"]


def _assert_same_plan(got, expected):
    for field in PLAN_FIELDS:
        assert torch.equal(getattr(got, field).cpu(), getattr(expected, field).cpu()), field
    if expected.tokens_per_rank_P is not None:
        assert torch.equal(got.tokens_per_rank_P.cpu(), expected.tokens_per_rank_P.cpu())
        assert torch.equal(got.token_to_rank_TP.cpu(), expected.token_to_rank_TP.cpu())


# (T, E, K, P): Qwen3-like top-8 of 128, DeepSeek-V2-Lite-like top-6 of 64, no tokens,
# top-1, a K that is not a power of two without ranks.
PLAN_CASES = [(70, 128, 8, 8), (90, 64, 6, 4), (0, 8, 2, 2), (5, 6, 1, 3), (33, 10, 3, None)]


@pytest.mark.parametrize("case", PLAN_CASES)
def test_plan_kernels_equal_the_eager_plan_in_interpreter(case):
    num_tokens, num_experts, topk, num_ranks = case
    topk_ids_TK, _ = _routing(num_tokens, num_experts, topk, seed=5)
    expected = plan_dispatch_reference(topk_ids_TK, num_experts, num_ranks=num_ranks)
    _assert_same_plan(_run_plan_kernels_for_test(topk_ids_TK, num_experts, num_ranks), expected)
    # Several programs (the GPU's grid): 3 steps of 8 tokens each at T = 70 and 90, none
    # for the last programs at T = 0 and 5.
    got = _run_plan_kernels_for_test(topk_ids_TK, num_experts, num_ranks, 4, block_tokens=8)
    _assert_same_plan(got, expected)


def test_plan_kernels_place_an_expert_a_token_picks_twice():
    # Routers pick distinct experts, but the plan does not rely on it: slots of one expert
    # in one token keep their slot order.
    topk_ids_TK = torch.randint(0, 5, (41, 4), generator=torch.Generator().manual_seed(3))
    expected = plan_dispatch_reference(topk_ids_TK, 5, num_ranks=5)
    got = _run_plan_kernels_for_test(topk_ids_TK, 5, 5, 3, block_tokens=8)
    _assert_same_plan(got, expected)


def test_plan_kernels_leave_out_int64_ids_that_wrap_into_range_as_int32():
    # 2**32 + 1 was cast to int32 before the range check and counted as expert 1.
    topk_ids_TK = torch.tensor([[0, 2**32 + 1], [1, 2], [-(2**32) + 3, 3]])
    plan = _run_plan_kernels_for_test(topk_ids_TK, 4, 2, 2, block_tokens=1)
    assert plan.tokens_per_expert_E.tolist() == [1, 1, 1, 1]
    assert plan.token_to_rank_TP.tolist() == [[1, 0], [1, 1], [0, 1]]
    assert plan.sorted_slot_R[:4].tolist() == [0, 2, 3, 5]


def test_plans_of_2_to_the_31_slots_or_more_take_the_int64_reference():
    # The kernel counts and places rows in int32: R = T·K >= 2**31 would wrap.
    assert _kernels_apply(torch.empty(2**28 - 1, 8, dtype=torch.int32, device="meta"))
    assert not _kernels_apply(torch.empty(2**28, 8, dtype=torch.int32, device="meta"))


def test_tokens_per_rank_count_each_token_once_per_rank():
    # 4 experts on 2 ranks: token 0 picks experts 0 and 1 (both rank 0): counted once.
    topk_ids_TK = torch.tensor([[0, 1], [1, 2], [3, 2], [0, 3]])
    for plan in (
        plan_dispatch(topk_ids_TK, 4, num_ranks=2),
        _run_plan_kernels_for_test(topk_ids_TK, 4, 2),
    ):
        assert plan.tokens_per_rank_P.tolist() == [3, 3]
        assert plan.token_to_rank_TP.tolist() == [[1, 0], [1, 1], [0, 1], [1, 1]]
        assert plan.tokens_per_expert_E.tolist() == [2, 2, 2, 2]


def test_plan_rejects_num_ranks_that_do_not_divide_experts():
    with pytest.raises(ValueError, match=r"must divide num_experts \(6\).*one of \[1, 2, 3, 6\]"):
        plan_dispatch(torch.tensor([[0, 1]]), num_experts=6, num_ranks=4)
    for num_ranks in (0, -2):
        with pytest.raises(ValueError, match=rf"num_ranks \({num_ranks}\) must be >= 1"):
            plan_dispatch(torch.tensor([[0, 1]]), num_experts=6, num_ranks=num_ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_unpermute_kernels_match_references_in_value_and_gradient(dtype):
    permute_fn, unpermute_fn = _kernel_functions_for_test()
    topk_ids_TK, weights_TK = _routing(23, 5, 3, seed=7)
    plan = plan_dispatch(topk_ids_TK, 5)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    x = torch.randn(23, 1100).to(dtype)  # 1100: more than one column block, ragged
    y = torch.randn(69, 1100).to(dtype)
    runs = []
    for perm, unperm in ((permute_fn, unpermute_fn),
                         (permute_reference, unpermute_reference)):  # fmt: skip
        x_leaf = x.clone().requires_grad_(True)
        y_leaf = y.clone().requires_grad_(True)
        w_leaf = weights_TK.clone().requires_grad_(True)
        routed = perm(x_leaf, plan)
        out = unperm(y_leaf, plan, w_leaf)
        gen = torch.Generator().manual_seed(0)
        routed.backward(torch.randn(routed.shape, generator=gen).to(dtype))
        out.backward(torch.randn(out.shape, generator=gen).to(dtype))
        runs.append([routed, out, x_leaf.grad, y_leaf.grad, w_leaf.grad])
    for got, expected in zip(*runs, strict=True):
        rel = float((got.double() - expected.double()).norm() / expected.double().norm())
        assert got.dtype == expected.dtype and rel <= tol


def test_fp64_permute_and_unpermute_where_kernels_run_are_computed_in_fp64(monkeypatch):
    # Where kernels run (CUDA; here the interpreter stands in), fp64 went to the kernels,
    # whose sums (permute's backward, unpermute) are fp32: ~1e-8 off, failing gradcheck.
    import mt_ops.moe_permute as permute_module

    monkeypatch.setattr(permute_module, "use_kernels", lambda *tensors: True)
    topk_ids_TK, weights_TK = _routing(5, 4, 2, seed=1)
    plan = plan_dispatch(topk_ids_TK, 4)
    x_TD = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y_RD = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    w_TK = weights_TK.double().requires_grad_(True)
    expected = y_RD[plan.row_of_slot_R].view(5, 2, 3).mul(w_TK[..., None]).sum(1)
    assert torch.equal(unpermute(y_RD, plan, w_TK), expected)
    assert torch.autograd.gradcheck(lambda y, w: unpermute(y, plan, w), (y_RD, w_TK))
    assert torch.autograd.gradcheck(lambda x: permute(x, plan), (x_TD,))
    out = unpermute(y_RD.detach().float().requires_grad_(), plan, weights_TK)
    assert "UnpermuteFn" in type(out.grad_fn).__name__  # fp32 still takes the kernels


def test_kept_rows_equal_the_full_permutation_cut_and_zero_padded():
    # Experts 0-2 kept, 3-4 dropped (as expert parallelism's bucket of other ranks' choices).
    topk_ids_TK, weights_TK = _routing(23, 5, 3, seed=3)
    plan = plan_dispatch(topk_ids_TK, 5)
    kept = int(plan.tokens_per_expert_E[:3].sum())
    assert 0 < kept < 69
    x, y = torch.randn(23, 300), torch.randn(kept, 300)
    grad_rows, grad_out = torch.randn(kept, 300), torch.randn(23, 300)
    ops = [(permute_reference, unpermute_reference), _kernel_functions_for_test()]
    for num_rows in (kept, 0):
        padded = torch.cat([y[:num_rows], y.new_zeros(69 - num_rows, 300)])
        full_out = unpermute_reference(padded, plan, weights_TK)
        for perm, unperm in [(permute, unpermute), *ops]:
            assert torch.equal(
                perm(x, plan, num_rows=num_rows), x[plan.sorted_token_ids_R][:num_rows]
            )
            out = unperm(y[:num_rows], plan, weights_TK, num_rows=num_rows)
            assert torch.allclose(out, full_out, atol=1e-6)
    # Gradients of the kernels equal the reference's; dropped slots get a zero weight gradient.
    grads = []
    for perm, unperm in ops:
        x_leaf, y_leaf = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        w_leaf = weights_TK.clone().requires_grad_(True)
        perm(x_leaf, plan, num_rows=kept).backward(grad_rows)
        unperm(y_leaf, plan, w_leaf, num_rows=kept).backward(grad_out)
        grads.append([x_leaf.grad, y_leaf.grad, w_leaf.grad])
    for got, expected in zip(*grads, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)
    dropped_slots = plan.row_of_slot_R.view(23, 3) >= kept
    assert dropped_slots.any() and (grads[1][2][dropped_slots] == 0).all()


def _autocast_permute_runs(device, perm_fns):
    """fp32 tokens permuted under bf16 autocast: (routed rows, x grad) per function."""
    topk_ids_TK, _ = _routing(23, 5, 3, seed=5)
    plan = plan_dispatch(topk_ids_TK.to(device), 5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 1100, generator=gen).to(device)
    grad_RD = torch.randn(69, 1100, generator=gen).bfloat16().to(device)
    runs = []
    for perm in perm_fns:
        x_leaf = x.clone().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            routed = perm(x_leaf, plan)
        routed.backward(grad_RD)
        runs.append((routed, x_leaf.grad))
    # Each token's gradient is the fp32 sum of its K bf16 row gradients.
    expected_grad = torch.zeros(23, 1100, device=device)
    expected_grad.index_add_(0, plan.sorted_token_ids_R, grad_RD.float())
    return runs, x[plan.sorted_token_ids_R].bfloat16(), expected_grad


def test_permute_under_autocast_moves_rows_in_the_autocast_dtype_and_sums_grads_in_fp32():
    permute_kernel, _ = _kernel_functions_for_test()
    runs, expected_rows, expected_grad = _autocast_permute_runs(
        "cpu", [permute, permute_reference, permute_kernel]
    )
    for i, (routed, grad) in enumerate(runs):
        assert routed.dtype == torch.bfloat16 and grad.dtype == torch.float32, i
        # (the interpreter's cast to bf16 may round differently: checked on GPU)
        tol = 1e-2 if i == 2 else 0.0
        assert float((routed.float() - expected_rows.float()).norm()) <= tol * float(
            expected_rows.float().norm()
        ), i
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_permute_traces_shapes_on_the_meta_device():
    # The meta device has no autocast: asking whether autocast is on there must not raise.
    topk_ids_TK, _ = _routing(6, 5, 2)
    plan = plan_dispatch(topk_ids_TK, 5)
    meta_plan = dataclasses.replace(
        plan,
        **{
            name: getattr(plan, name).to("meta")
            for name in (
                "tokens_per_expert_E",
                "sorted_token_ids_R",
                "sorted_slot_R",
                "row_of_slot_R",
            )
        },
    )
    routed_RD = permute(torch.empty(6, 8, device="meta"), meta_plan)
    assert routed_RD.shape == (12, 8) and routed_RD.device.type == "meta"


def test_kept_rows_are_checked():
    topk_ids_TK, weights_TK = _routing(4, 5, 2)
    plan = plan_dispatch(topk_ids_TK, 5)
    with pytest.raises(ValueError, match=r"num_rows \(9\) must be in \[0, T·K = 8\]"):
        permute(torch.randn(4, 6), plan, num_rows=9)
    with pytest.raises(TypeError, match="num_rows must be a Python int, got Tensor"):
        permute(torch.randn(4, 6), plan, num_rows=torch.tensor(3))
    with pytest.raises(ValueError, match=r"must be \[R=3, D\].*kept"):
        unpermute(torch.randn(8, 6), plan, weights_TK, num_rows=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [(16384, 128, 8, 8), (16384, 64, 6, 4), (3, 8, 2, None)])
def test_plan_permute_unpermute_kernels_on_gpu_equal_references(case):
    num_tokens, num_experts, topk, num_ranks = case
    topk_ids_TK, weights_TK = _routing(num_tokens, num_experts, topk, seed=11)
    topk_ids_TK, weights_TK = topk_ids_TK.cuda(), weights_TK.cuda()
    plan = plan_dispatch(topk_ids_TK, num_experts, num_ranks=num_ranks)
    _assert_same_plan(plan, plan_dispatch_reference(topk_ids_TK, num_experts, num_ranks=num_ranks))
    x = torch.randn(num_tokens, 2048, device="cuda").bfloat16().requires_grad_(True)
    routed = permute(x, plan)
    assert torch.equal(routed, permute_reference(x.detach(), plan))
    y = torch.randn_like(routed).requires_grad_(True)
    w = weights_TK.clone().requires_grad_(True)
    out = unpermute(y, plan, w)
    y2, w2 = y.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out2 = unpermute_reference(y2, plan, w2)
    assert float((out.float() - out2.float()).norm() / out2.float().norm()) <= 1e-2
    grad = torch.randn_like(out)
    out.backward(grad)
    out2.backward(grad)
    assert float((y.grad.float() - y2.grad.float()).norm() / y2.grad.float().norm()) <= 1e-2
    assert float((w.grad - w2.grad).norm() / w2.grad.norm()) <= 1e-5
    if num_ranks is None:  # once: fp32 tokens under autocast, against the reference
        runs, expected_rows, expected_grad = _autocast_permute_runs(
            "cuda", [permute, permute_reference]
        )
        for routed, grad in runs:
            assert torch.equal(routed, expected_rows)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)
