"""Canonical names are the Hugging Face Hub keys of Qwen3-MoE, one key per expert."""

import pytest
import torch

from mt_models import Qwen3MoeForCausalLM
from mt_models.qwen3_moe import debug


def _expected_hub_keys(num_layers=4, num_experts=8, dense_layers=(), tied=False):
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        keys.add("lm_head.weight")
    for i in range(num_layers):
        p = f"model.layers.{i}"
        keys |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        keys |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        keys |= {f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"}
        names = ("gate_proj", "up_proj", "down_proj")
        if i in dense_layers:
            keys |= {f"{p}.mlp.{n}.weight" for n in names}
        else:
            keys.add(f"{p}.mlp.gate.weight")
            keys |= {f"{p}.mlp.experts.{e}.{n}.weight" for e in range(num_experts) for n in names}
    return keys


def test_canonical_keys_are_the_hub_keys_of_the_debug_config(build_debug_model):
    model = build_debug_model()
    assert set(model.canonical_parameters()) == _expected_hub_keys()


def test_dense_layers_and_tied_embeddings_change_the_key_set():
    model = Qwen3MoeForCausalLM(
        __import__("dataclasses").replace(debug(), mlp_only_layers=(0, 2), tie_word_embeddings=True)
    )
    expected = _expected_hub_keys(dense_layers=(0, 2), tied=True)
    assert set(model.canonical_parameters()) == expected


def test_non_expert_parameter_names_already_are_hub_keys(build_debug_model):
    model = build_debug_model()
    hub = _expected_hub_keys()
    for name, _ in model.named_parameters():
        assert (name in hub) != (".mlp.experts." in name), name


def test_expert_tensors_are_views_sharing_storage(build_debug_model):
    model = build_debug_model()
    stacked = model.model.layers[1].mlp.experts.down_proj.weight  # [E, D, F]
    view = model.canonical_parameters()["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert view.shape == (128, 96)
    assert view.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    with torch.no_grad():
        view.fill_(3.0)
    assert torch.all(stacked[5] == 3.0) and not torch.all(stacked[4] == 3.0)


def test_optimizer_state_shaped_tensors_map_like_parameters(build_debug_model):
    model = build_debug_model()
    exp_avg = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    canonical = model.to_canonical(exp_avg)
    assert set(canonical) == _expected_hub_keys()
    canonical["model.layers.0.mlp.experts.2.up_proj.weight"].add_(1.0)
    assert exp_avg["model.layers.0.mlp.experts.up_proj.weight"][2].sum() == 96 * 128


def test_to_canonical_rejects_unknown_names(build_debug_model):
    with pytest.raises(ValueError, match="not a parameter name"):
        build_debug_model().to_canonical(
            {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(1)}
        )
