"""The five phases composed by hand equal forward(). Legend: B, S, T, D, E, K, R."""

from types import SimpleNamespace

import pytest
import torch

from mt_models import Dispatcher, LayerOutput, LocalDispatcher, MoEDecoderLayer, Routed


def _input(dim, seed=0):
    return torch.randn(2, 13, dim, generator=torch.Generator().manual_seed(seed))


def test_phases_composed_by_hand_equal_forward_for_moe_layer(build_debug_model):
    model = build_debug_model()
    layer = model.model.layers[0]
    assert isinstance(layer.dispatcher, LocalDispatcher)
    x_BSD = _input(128)

    routed = layer.attend(x_BSD)
    tokens_RD, tokens_per_expert_E, handle = layer.dispatcher.dispatch(routed)
    expert_out_RD = layer.experts(tokens_RD, tokens_per_expert_E)
    expert_out_TD = layer.dispatcher.combine(expert_out_RD, handle)
    by_hand_BSD = layer.aggregate(expert_out_TD, routed)

    out = layer(x_BSD)
    assert isinstance(out, LayerOutput)
    assert torch.equal(by_hand_BSD, out.hidden_BSD)
    assert torch.equal(routed.router_stats.prob_sum_E, out.router_stats.prob_sum_E)
    assert tokens_RD.shape == (2 * 13 * 2, 128) and int(tokens_per_expert_E.sum()) == 52


def test_phases_composed_by_hand_equal_forward_for_dense_layer(build_debug_model):
    model = build_debug_model(mlp_only_layers=(1,))
    layer = model.model.layers[1]
    assert layer.dispatcher is None
    x_BSD = _input(128, seed=1)

    routed = layer.attend(x_BSD)
    assert routed.topk_ids_TK is None and routed.topk_weights_TK is None
    assert routed.router_stats is None
    by_hand_BSD = layer.aggregate(layer.experts(routed.hidden_TD, None), routed)

    out = layer(x_BSD)
    assert torch.equal(by_hand_BSD, out.hidden_BSD)
    assert out.router_stats is None


def test_layers_and_dispatcher_satisfy_the_protocols(build_debug_model):
    layer = build_debug_model().model.layers[0]
    assert isinstance(layer, MoEDecoderLayer)
    assert isinstance(layer.dispatcher, Dispatcher)


def test_moe_layer_equals_per_token_loop_over_chosen_experts(build_debug_model):
    """Hugging Face semantics: out = h + Σ_k w_k · expert_{id_k}(norm(h))."""
    layer = build_debug_model().model.layers[0]
    x_BSD = _input(128, seed=2)
    routed: Routed = layer.attend(x_BSD)
    experts = layer.mlp.experts
    rows = []
    for t in range(routed.hidden_TD.shape[0]):
        h_D = routed.hidden_TD[t]
        acc_D = torch.zeros(128)
        for k in range(2):
            e = int(routed.topk_ids_TK[t, k])
            act_F = torch.nn.functional.silu(experts.gate_proj.weight[e] @ h_D) * (
                experts.up_proj.weight[e] @ h_D
            )
            acc_D = acc_D + routed.topk_weights_TK[t, k] * (experts.down_proj.weight[e] @ act_F)
        rows.append(routed.residual_TD[t] + acc_D)
    expected_BSD = torch.stack(rows).view(2, 13, 128)
    torch.testing.assert_close(layer(x_BSD).hidden_BSD, expected_BSD, rtol=1e-5, atol=1e-5)


def test_router_weights_sum_to_one_with_norm_topk_prob(build_debug_model):
    layer = build_debug_model().model.layers[2]
    routed = layer.attend(_input(128, seed=3))
    sums_T = routed.topk_weights_TK.sum(-1)
    torch.testing.assert_close(sums_T, torch.ones_like(sums_T))
    assert routed.topk_weights_TK.dtype == torch.float32


def test_local_dispatcher_runs_experts_from_tokens_when_they_offer_it(build_debug_model):
    from mt_ops import convert_to_fp8

    model = build_debug_model()
    layer = model.model.layers[0]
    convert_to_fp8(model)  # FP8 experts: forward_tokens fuses permute and unpermute on GPU
    routed = layer.attend(_input(128, seed=3))
    tokens_RD, tokens_per_expert_E, handle = layer.dispatcher.dispatch(routed)
    phases = layer.dispatcher.combine(layer.experts(tokens_RD, tokens_per_expert_E), handle)
    calls = []
    experts = layer.mlp.experts
    forward_tokens = experts.forward_tokens
    experts.forward_tokens = lambda *args: calls.append(len(args)) or forward_tokens(*args)
    assert torch.equal(layer.dispatcher.run_experts(routed, experts), phases)
    assert calls == [2]
    plain = torch.nn.Module()  # experts without forward_tokens (GPT-OSS) take the phases
    plain.forward = experts.forward
    assert torch.equal(layer.dispatcher.run_experts(routed, plain), phases)
    assert calls == [2]


def test_an_moe_layers_experts_without_counts_is_a_value_error_naming_where_they_come_from(
    build_debug_model,
):
    # An assert before: under python -O the experts ran with None counts and failed inside.
    layer = build_debug_model().model.layers[0]
    routed = layer.attend(_input(128))
    with pytest.raises(ValueError, match=r"^experts: tokens_per_expert_E is None, but this is "
                       r"an MoE layer: pass the counts its dispatcher's dispatch\(routed\) "
                       r"returns"):  # fmt: skip
        layer.experts(routed.hidden_TD, None)


def test_dispatching_a_dense_layers_routed_is_a_value_error(build_debug_model):
    model = build_debug_model(mlp_only_layers=(1,))
    dense = model.model.layers[1].attend(_input(128))
    dispatcher = model.model.layers[0].dispatcher
    fused = SimpleNamespace(forward_tokens=lambda *args: pytest.fail("ran the experts"))
    for name, call in (("dispatch", lambda: dispatcher.dispatch(dense)),
                       ("run_experts", lambda: dispatcher.run_experts(dense, fused))):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^LocalDispatcher.{name}: routed has no top-k "
                           r"\(topk_ids_TK None, topk_weights_TK None\): it is a dense layer's "
                           r"attend output"):  # fmt: skip
            call()
