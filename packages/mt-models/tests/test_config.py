"""Config validation, presets, registry and the FLOP count."""

import dataclasses

import pytest
import torch

from mt_models import MODEL_FAMILIES, Qwen3MoeConfig, Qwen3MoeForCausalLM, build_model
from mt_models.qwen3_moe import debug, qwen3_30b_a3b, qwen3_235b_a22b


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": (4,)}, "mlp_only_layers"),
        ({"head_dim": 31}, "head_dim"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_config_rejects_invalid_values_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(debug(), **overrides)


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [(qwen3_30b_a3b, 30.5e9, 3.3e9), (qwen3_235b_a22b, 235.1e9, 22.2e9)],
)
def test_presets_have_the_published_parameter_counts(preset, total, active):
    config = preset()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    num_active = num_params - expert_params * (1 - 8 / 128)
    assert abs(num_params - total) / total < 0.01
    assert abs(num_active - active) / active < 0.03


def test_registry_builds_the_family_of_the_config():
    assert MODEL_FAMILIES["qwen3_moe"] == (Qwen3MoeConfig, Qwen3MoeForCausalLM)
    with torch.device("meta"):
        assert isinstance(build_model(debug()), Qwen3MoeForCausalLM)
    with pytest.raises(ValueError, match="no model family"):
        build_model(object())


def test_flops_per_token_of_debug_config_matches_hand_count():
    model = Qwen3MoeForCausalLM(debug())
    seq_len = 64
    attn_proj = 2 * 128 * 32 * (4 + 2 + 2 + 4)  # q, k, v, o
    scores = 2 * 4 * (32 + 32) * seq_len / 2
    router = 2 * 128 * 8
    experts = 2 * 3 * 2 * 128 * 96  # top-2 of gate, up, down
    head = 2 * 128 * 4096
    expected = 3 * (4 * (attn_proj + scores + router + experts) + head)
    assert model.flops_per_token(seq_len) == pytest.approx(expected)


def test_flops_per_token_is_six_times_active_matmul_params_plus_attention():
    model = Qwen3MoeForCausalLM(dataclasses.replace(debug(), mlp_only_layers=(1,)))
    active = 0
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "embed_tokens" in name:
            continue
        active += p.numel() * (2 / 8 if ".experts." in name else 1)
    attention = 3 * 4 * 2 * 4 * 64 * 100 / 2
    assert model.flops_per_token(100) == pytest.approx(6 * active + attention)
    assert model.flops_per_token(100) > 0


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("deepseek_v2", {"topk_group": 5}, "group_limited_greedy needs"),
        ("deepseek_v2", {"topk_group": 1, "num_experts_per_tok": 3}, "exceeds the 2 experts"),
        ("qwen3_moe", {"load_balancing": "mean"}, "load_balancing"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v2", {"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
        ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types"),
        ("gpt_oss", {"swiglu_limit": 0.0}, "swiglu_limit"),
        ("qwen3_moe", {"aux_loss_type": "batch"}, "aux_loss_type"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "longrope"}}, "not supported"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": None}, "sliding_window"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 0.0}}, r"factor \(0.0\)"),
        ("deepseek_v2", {"rope_scaling": {"type": "linear", "factor": -2.0}}, r"factor \(-2.0\)"),
        (
            "gpt_oss",
            {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 0}},
            r"original_max_position_embeddings \(0\)",
        ),
    ],
)
def test_family_configs_reject_invalid_values_naming_them(family, overrides, message):
    debug_preset = __import__(f"mt_models.{family}", fromlist=["debug"]).debug
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(debug_preset(), **overrides)


def test_every_family_is_registered_and_exposes_num_experts():
    for name, (config_cls, model_cls) in MODEL_FAMILIES.items():
        config = __import__(f"mt_models.{name}", fromlist=["debug"]).debug()
        assert type(config) is config_cls and config.num_experts == 8
        with torch.device("meta"):
            assert type(build_model(config)) is model_cls


def test_deepseek_yarn_with_mscale_all_dim_and_no_factor_is_refused_naming_the_factor():
    # MLA's softmax-scale correction needs the factor: such a config used to pass
    # validation and then fail building the model with a bare KeyError('factor').
    from mt_models.deepseek_v2 import debug as deepseek_debug

    yarn = {"rope_type": "yarn", "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="sets mscale_all_dim but no factor"):
        dataclasses.replace(deepseek_debug(), rope_scaling=yarn)
    config = dataclasses.replace(deepseek_debug(), rope_scaling={**yarn, "factor": 4.0})
    with torch.device("meta"):
        build_model(config)


def test_gpt_oss_depth_change_error_says_to_reset_the_derived_layer_types():
    # layer_types is filled in from num_hidden_layers, so replace() (or an mt-train
    # override) of the depth alone keeps the old list; the error did not say what to do.
    from mt_models.gpt_oss import debug as gpt_oss_debug

    with pytest.raises(ValueError, match=r"4 layers; after changing num_hidden_layers, set"):
        dataclasses.replace(gpt_oss_debug(), num_hidden_layers=4, layer_types=["full_attention"])
    with pytest.raises(ValueError, match=r"or to None for the default"):
        dataclasses.replace(gpt_oss_debug(), num_hidden_layers=2)
    config = dataclasses.replace(gpt_oss_debug(), num_hidden_layers=2, layer_types=None)
    assert config.layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "linear", "factor": "x"}, r"rope_scaling factor \('x'\) must be a number"),
        ({"rope_type": "yarn", "factor": [2]}, r"rope_scaling factor \(\[2\]\) must be a number"),
        ({"rope_type": "linear", "factor": True}, r"rope_scaling factor \(True\) must be a num"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "x"},
         r"rope_scaling original_max_position_embeddings \('x'\) must be a number"),
        ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"},
         r"rope_scaling beta_fast \('x'\) must be a number"),
        ({"rope_type": "yarn", "factor": 2.0, "attention_factor": None, "mscale": "1"},
         r"rope_scaling mscale \('1'\) must be a number"),
        ({"rope_type": "yarn", "factor": 2.0, "truncate": "no"},
         r"rope_scaling truncate \('no'\) must be true or false"),
    ],
)  # fmt: skip
def test_rope_scaling_values_of_the_wrong_type_are_refused_naming_them(scaling, message):
    # They raised TypeError ("'>' not supported between 'str' and 'int'") or passed, to
    # fail when the model was built.
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(debug(), rope_scaling=scaling)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_infinite_float_field_is_refused_naming_it(family, bad):
    # The range checks read 'value <= 0', which NaN passes: a NaN rms_norm_eps or rope_theta
    # built a model that trained on NaN; an infinite coefficient is no JSON for config.json.
    config = __import__(f"mt_models.{family}", fromlist=["debug"]).debug()
    names = [f.name for f in dataclasses.fields(config) if type(getattr(config, f.name)) is float]
    assert {"rms_norm_eps", "rope_theta", "initializer_range", "router_aux_loss_coef"} <= set(names)
    for name in names:
        with pytest.raises(ValueError, match=rf"^{name} \({bad}\) must be a finite number"):
            dataclasses.replace(config, **{name: bad})


@pytest.mark.parametrize(
    "name",
    ["factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "mscale"],
)
def test_a_nan_or_infinite_rope_scaling_number_is_refused_naming_it(name):
    from mt_models.gpt_oss import debug as gpt_oss_debug

    config = gpt_oss_debug()
    for bad in (float("nan"), float("inf")):
        scaling = {**config.rope_scaling, name: bad}
        with pytest.raises(ValueError, match=rf"^rope_scaling {name} \({bad}\) must be a finite"):
            dataclasses.replace(config, rope_scaling=scaling)
