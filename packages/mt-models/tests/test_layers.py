"""Shared layers across families: phases, the swappable attention core, router variants,
auxiliary losses and the stats reducer, expert biases, layout-independent init."""

import pytest
import torch

from mt_models import LocalAttention, RouterStats
from mt_models.layers import TopKRouter, load_balancing_loss
from mt_ops import GroupedLinear, grouped_linear, grouped_linear_reference

MOE_LAYER = {"qwen3_moe": 0, "deepseek_v2": 1, "gpt_oss": 0}
FAMILIES = list(MOE_LAYER)


def _x(seed=0, shape=(2, 13, 128)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_phases_composed_by_hand_equal_forward_for_every_family(family, build_debug_model):
    layer = build_debug_model(family=family).model.layers[MOE_LAYER[family]]
    x_BSD, positions = _x(), torch.arange(3, 16)
    routed = layer.attend(x_BSD, positions)
    tokens_RD, tokens_per_expert_E, handle = layer.dispatcher.dispatch(routed)
    out_TD = layer.dispatcher.combine(layer.experts(tokens_RD, tokens_per_expert_E), handle)
    by_hand_BSD = layer.aggregate(out_TD, routed)
    assert torch.equal(by_hand_BSD, layer(x_BSD, positions).hidden_BSD)
    assert (routed.shared_out_TD is not None) == (family == "deepseek_v2")


class RecordingCore:
    """A stand-in for mt-parallel's context-parallel core: records its arguments, then runs
    the local one."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, positions_S, scale, window, sinks_H):
        self.calls.append(dict(q=q.shape, v=v.shape, pos=positions_S, window=window, sinks=sinks_H))
        return LocalAttention()(
            q, k, v, positions_S=positions_S, scale=scale, window=window, sinks_H=sinks_H
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_core_is_swappable_and_sees_positions_window_and_sinks(family, build_debug_model):
    model = build_debug_model(family=family)
    ids = torch.randint(0, 4096, (2, 10))
    positions = torch.arange(7, 17)
    expected = model(ids, position_ids=positions)
    core = RecordingCore()
    for layer in model.model.layers:
        layer.self_attn.attention_core = core
    assert torch.equal(model(ids, position_ids=positions), expected)
    first = core.calls[0]
    assert len(core.calls) == len(model.model.layers) and torch.equal(first["pos"], positions)
    if family == "gpt_oss":
        assert [c["window"] for c in core.calls] == [64, None, 64, None]
        assert first["sinks"].shape == (4,)
    if family == "deepseek_v2":
        assert first["q"][-1] == 48 and first["v"][-1] == 32  # MLA: d_qk ≠ d_v


def test_position_ids_set_rope_and_restarts_mark_packed_documents(build_debug_model):
    model = build_debug_model(family="deepseek_v2")
    ids = torch.randint(0, 4096, (2, 10))
    shifted = model(ids, position_ids=torch.arange(5, 15))
    by_row = model(ids, position_ids=torch.arange(5, 15)[None].expand(2, -1))
    torch.testing.assert_close(by_row, shifted)
    # RoPE is relative: a uniform shift changes nothing.
    torch.testing.assert_close(model(ids), shifted, rtol=1e-5, atol=1e-5)
    # Positions that restart start a new document: it attends only to itself.
    packed = model(ids, position_ids=torch.cat([torch.arange(4), torch.arange(6)]))
    torch.testing.assert_close(packed[:, :4], model(ids[:, :4]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 4:], model(ids[:, 4:]), rtol=1e-5, atol=1e-5)


def test_router_stats_reducer_sees_every_moe_layer_and_carries_the_router_gradient(
    build_debug_model,
):
    model = build_debug_model(family="deepseek_v2")  # 2 MoE layers, sequence-wise loss
    model.config.aux_loss_type = "global"
    ids = torch.randint(0, 4096, (2, 12))
    plain = model.loss(ids, ids)
    seen = []

    def reducer(stats: RouterStats) -> RouterStats:  # as if a second rank had the same tokens
        seen.append(stats)
        return RouterStats(**{k: v * 2 for k, v in vars(stats).items()})

    model.router_stats_reducer = reducer
    reduced = model.loss(ids, ids)
    assert len(seen) == 2
    torch.testing.assert_close(reduced.aux_loss, plain.aux_loss)  # ratios unchanged
    reduced.aux_loss.backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_variants_and_z_loss_are_switchable_and_logged(build_debug_model):
    model = build_debug_model(family="gpt_oss")
    ids = torch.randint(0, 4096, (3, 16))
    out = model.loss(ids, ids)
    assert set(out.losses) == {"load_balancing_loss", "router_z_loss"}
    coef = model.config.router_aux_loss_coef
    torch.testing.assert_close(out.aux_loss, coef * out.losses["load_balancing_loss"])
    model.config.router_z_loss_coef = 0.5
    with_z = model.loss(ids, ids)
    torch.testing.assert_close(with_z.aux_loss, out.aux_loss + 0.5 * out.losses["router_z_loss"])
    model.config.aux_loss_type = "sequence"
    per_sequence = model.loss(ids, ids).losses["load_balancing_loss"]
    assert per_sequence > out.losses["load_balancing_loss"]  # short sequences balance worse


def test_group_limited_routing_picks_experts_from_at_most_topk_group_groups():
    router = TopKRouter(16, 8, 3, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    torch.nn.init.normal_(router.weight)
    out = router(torch.randn(64, 16))
    groups_per_token = [len(set((ids // 2).tolist())) for ids in out.topk_ids_TK]
    assert max(groups_per_token) <= 2 and min(groups_per_token) >= 1
    assert torch.all(out.topk_weights_TK.sum(-1) <= 2.0 + 1e-6)


def test_sigmoid_router_expert_bias_moves_choices_not_weights():
    router = TopKRouter(16, 8, 2, scoring_func="sigmoid", norm_topk_prob=True, expert_bias=True)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.data.zero_()
    hidden = torch.randn(32, 16)
    before = router(hidden)
    router.e_score_correction_bias.data[5] = 10.0  # everyone now picks expert 5
    after = router(hidden)
    assert torch.all((after.topk_ids_TK == 5).any(-1))
    scores = torch.sigmoid(hidden @ router.weight.T).gather(1, after.topk_ids_TK)
    torch.testing.assert_close(after.topk_weights_TK, scores / scores.sum(-1, keepdim=True))
    assert not torch.equal(before.topk_ids_TK, after.topk_ids_TK)
    router.update_expert_bias(after.stats.tokens_per_expert_E, rate=0.1)
    assert router.e_score_correction_bias[5] == pytest.approx(9.9)  # overloaded: lowered


def test_grouped_linear_bias_is_added_per_expert_row_and_its_grad_is_a_segmented_sum():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    bias = torch.randn(3, 4, generator=gen, requires_grad=True)
    counts = torch.tensor([2, 0, 5])
    expected = torch.cat([x[:2] @ w[0].T + bias[0], x[2:] @ w[2].T + bias[2]])
    for fn in (grouped_linear, grouped_linear_reference):
        torch.testing.assert_close(fn(x, w, counts, bias), expected)
    grouped_linear(x, w, counts, bias).sum().backward()
    torch.testing.assert_close(bias.grad, torch.tensor([[2.0] * 4, [0.0] * 4, [5.0] * 4]))
    assert GroupedLinear(3, 5, 4, bias=True).bias.shape == (3, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_init_of_an_expert_slice_equals_the_same_experts_of_the_whole_model(
    family, build_debug_model
):
    """What an expert-parallel rank holding experts 4..7 of 8 gets from init_weights."""
    whole = build_debug_model(seed=11, family=family).canonical_parameters()
    sliced = build_debug_model(seed=0, family=family)
    for module in sliced.modules():
        if hasattr(module, "first_expert_id"):
            module.num_experts, module.first_expert_id = 4, 4
            for name, child in list(module.named_children()):
                has_bias = child.bias is not None
                setattr(
                    module, name, GroupedLinear(4, child.in_features, child.out_features, has_bias)
                )
    sliced.init_weights(11)
    params = sliced.canonical_parameters()
    assert len(params) < len(whole)
    assert not any(".experts.0." in k for k in params)
    for key, value in params.items():
        assert torch.equal(value, whole[key]), key
    assert any(".experts.7." in k for k in params)


def test_load_balancing_loss_is_k_for_uniform_routing():
    stats = RouterStats(
        tokens_per_expert_E=torch.full((8,), 4.0),
        prob_sum_E=torch.full((8,), 2.0),
        num_tokens=torch.tensor(16),
        z_sum=torch.tensor(0.0),
        tokens_per_expert_BE=torch.full((1, 8), 4.0),
        prob_sum_BE=torch.full((1, 8), 2.0),
        num_tokens_B=torch.tensor([16]),
    )
    assert load_balancing_loss(stats).item() == pytest.approx(2.0)
