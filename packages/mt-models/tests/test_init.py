"""init_weights is a function of (seed, canonical name) only."""

import math

import torch

from mt_models import Qwen3MoeForCausalLM
from mt_models.qwen3_moe import debug


def _canonical(model):
    return {k: v.detach().clone() for k, v in model.canonical_parameters().items()}


def test_same_seed_gives_identical_weights(build_debug_model):
    a, b = _canonical(build_debug_model(seed=7)), _canonical(build_debug_model(seed=7))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seed_changes_every_random_weight(build_debug_model):
    a, b = _canonical(build_debug_model(seed=7)), _canonical(build_debug_model(seed=8))
    for name in a:
        if name.endswith("norm.weight"):
            assert torch.equal(a[name], b[name]), name  # ones, by rule
        else:
            assert not torch.equal(a[name], b[name]), name


def test_expert_weights_do_not_depend_on_the_number_of_experts(build_debug_model):
    eight = _canonical(build_debug_model(seed=3, num_experts=8))
    sixteen = _canonical(build_debug_model(seed=3, num_experts=16))
    compared = 0
    for name, value in eight.items():
        if name.endswith("mlp.gate.weight"):
            continue  # the router's shape is [E, D]
        assert torch.equal(value, sixteen[name]), name
        compared += ".experts." in name
    assert compared == 4 * 8 * 3


def test_meta_build_then_to_empty_equals_cpu_build(build_debug_model):
    on_cpu = Qwen3MoeForCausalLM(debug())
    on_cpu.init_weights(5)
    from_meta = _canonical(build_debug_model(seed=5))
    for name, value in on_cpu.canonical_parameters().items():
        assert torch.equal(value, from_meta[name]), name


def test_init_rules_ones_for_norms_scaled_std_for_output_projections(build_debug_model):
    params = build_debug_model().canonical_parameters()
    assert torch.all(params["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert torch.all(params["model.norm.weight"] == 1)
    std = params["model.embed_tokens.weight"].std().item()
    assert abs(std - 0.02) < 0.002
    o_std = (
        torch.cat([params[f"model.layers.{i}.self_attn.o_proj.weight"].flatten() for i in range(4)])
        .std()
        .item()
    )
    assert abs(o_std - 0.02 / math.sqrt(8)) < 0.001


def test_init_skipping_meta_gives_the_materialized_layers_the_whole_models_values():
    # A pipeline rank builds on meta and materializes its own stages only.
    config = debug()
    with torch.device("meta"):
        whole, part = Qwen3MoeForCausalLM(config), Qwen3MoeForCausalLM(config)
    whole.to_empty(device="cpu")
    whole.init_weights(seed=3)
    part.model.layers[1].to_empty(device="cpu")
    part.init_weights(seed=3, skip_meta=True)
    values = dict(whole.named_parameters())
    kept = [name for name, p in part.named_parameters() if not p.is_meta]
    assert kept and all(name.startswith("model.layers.1.") for name in kept)
    for name in kept:
        assert torch.equal(part.get_parameter(name), values[name]), name
