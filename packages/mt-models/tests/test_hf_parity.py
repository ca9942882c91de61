"""Parity with transformers on tiny random fp32 configs of every family: logits within 1e-4
absolute, loss gradients within 1e-4 relative, and load_hf → save_hf → transformers."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from mt_models import load_hf, save_hf
from mt_models.hf_config import config_from_hf

pytest.importorskip("transformers")

SEQ_LEN = 24  # longer than every window below but one
VOCAB = 96
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "qwen3_yarn_attention_factor_window_renormalized_topk_dense_layer": (
        "qwen3_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=8,
            max_position_embeddings=128,
            rope_parameters={
                **YARN,
                "rope_theta": 10000.0,
                "attention_factor": 1.3,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
    ),
    "qwen3_unnormalized_topk_sparse_step_2_tied_attention_bias_linear_rope": (
        "qwen3_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        ),
    ),
    "deepseek_q_lora_group_limited_yarn_mscale_first_dense": (
        "deepseek_v2",
        dict(
            kv_lora_rank=32,
            q_lora_rank=40,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            max_position_embeddings=128,
            rope_parameters={
                **YARN,
                "rope_theta": 10000.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    "deepseek_no_q_lora_greedy_biases": (
        "deepseek_v2",
        dict(
            kv_lora_rank=24,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=0,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "gpt_oss_yarn_untruncated_alternating_windows_sinks": (
        "gpt_oss",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            max_position_embeddings=256,
            rope_parameters={
                **YARN,
                "factor": 8.0,
                "rope_theta": 150000.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
    "gpt_oss_window_longer_than_the_sequence_no_attention_bias_clamping_swiglu": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            sliding_window=SEQ_LEN + 7,
            attention_bias=False,
            rms_norm_eps=0.05,
            swiglu_alpha=1.3,
            swiglu_limit=0.5,  # below many gate/up values of these random weights
        ),
    ),
    "gpt_oss_truncated_yarn_custom_layer_types_tied": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            tie_word_embeddings=True,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={**YARN, "rope_theta": 10000.0},
        ),
    ),
}

COMMON = {
    "qwen3_moe": dict(
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "deepseek_v2": dict(
        hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_attention_heads=4
    ),
    "gpt_oss": dict(
        hidden_size=48,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def _hf_config(family, kwargs):
    return {"vocab_size": VOCAB, "num_hidden_layers": 3, **COMMON[family], **kwargs}


def _hf_names(model, family, tensors):
    """Our tensors keyed by FQN → transformers' in-memory names and layouts (fused experts)."""
    out = {}
    pattern = re.compile(
        r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|gate_up_proj|down_proj)\.(weight|bias)$"
    )
    for fqn, t in tensors.items():
        match = pattern.match(fqn)
        if match is None:
            out[fqn] = t
            continue
        prefix, proj, kind = match.groups()
        if family == "gpt_oss":
            out[f"{prefix}.{proj}" + ("_bias" if kind == "bias" else "")] = (
                t if kind == "bias" else t.transpose(1, 2)
            )
        elif proj == "down_proj":
            out[f"{prefix}.down_proj"] = t
        elif proj == "gate_proj":
            out[f"{prefix}.gate_up_proj"] = torch.cat(
                [t, tensors[f"{prefix}.up_proj.weight"]], dim=1
            )
    return out


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=gen)
    return ids, torch.randint(0, VOCAB, (2, SEQ_LEN), generator=gen)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_gradients_match_transformers(name, hf, tmp_path):
    family, kwargs = CASES[name]
    reference = hf.model(family, seed=3, **_hf_config(family, kwargs))
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids, labels = _inputs()
    positions = torch.arange(5, 5 + SEQ_LEN)[None].expand(2, -1)  # a slice further along

    ref_logits = reference(ids, position_ids=positions).logits
    logits = ours(ids, position_ids=positions)
    assert logits.shape == (2, SEQ_LEN, VOCAB)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.allclose(ours(ids), reference(ids).logits, rtol=0, atol=1e-4)

    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = _hf_names(ours, family, {n: p.grad for n, p in ours.named_parameters()})
    if reference.config.tie_word_embeddings:
        ref_grads.pop("lm_head.weight", None)
    assert set(grads) == set(ref_grads)
    for key, ref_grad in ref_grads.items():
        error = (grads[key] - ref_grad).norm().item()
        assert error <= 1e-4 * ref_grad.norm().item() + 1e-9, (key, error, ref_grad.norm().item())


@pytest.mark.parametrize("name", list(CASES))
def test_load_save_round_trip_through_transformers(name, hf, tmp_path):
    import transformers

    family, kwargs = CASES[name]
    reference = hf.model(family, seed=4, **_hf_config(family, kwargs))
    reference.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several shards
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "ours", max_shard_size=30_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    )
    assert reloaded.dtype == torch.float32
    ids, _ = _inputs(2)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
        assert torch.equal(load_hf(tmp_path / "ours")(ids), ours(ids))
    expected = reference.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_gpt_oss_without_a_window_exports_full_attention_that_transformers_runs_equal(
    build_debug_model, hf, tmp_path
):
    # transformers' GPT-OSS fails on "sliding_window": null (it builds a sliding-window
    # mask every forward, and a cache layer of that window per "sliding_attention" layer);
    # our sliding layers attend fully without a window, and so must the export.
    import transformers

    ours = build_debug_model(seed=0, family="gpt_oss", vocab_size=VOCAB, sliding_window=None)
    hf.randomize(ours, seed=5)
    assert "sliding_attention" in ours.config.layer_types
    save_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] * ours.config.num_hidden_layers
    assert config["sliding_window"] == ours.config.max_position_embeddings
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    ids, _ = _inputs(3)
    with torch.no_grad():
        logits = ours(ids)
        for use_cache in (True, False):
            ref_logits = reference(ids, use_cache=use_cache).logits
            assert (ref_logits - logits).abs().max().item() <= 1e-4, use_cache
        assert torch.equal(load_hf(tmp_path)(ids), logits)  # and back: the same function


def test_deepseek_without_shared_experts_loads_from_and_exports_to_transformers(hf, tmp_path):
    # transformers builds DeepSeek-V2's shared_experts with intermediate size 0 when
    # n_shared_experts is 0 and saves its empty weights; load_hf refused them as unexpected.
    import transformers

    # (With mlp_bias its down_proj.bias [D] is not empty: a constant shared output our model
    # does not hold, still refused as unexpected.)
    kwargs = dict(CASES["deepseek_no_q_lora_greedy_biases"][1], n_shared_experts=0, mlp_bias=False)
    reference = hf.model("deepseek_v2", seed=6, **_hf_config("deepseek_v2", kwargs))
    reference.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert not any("shared_experts" in name for name, _ in ours.named_parameters())
    ids, _ = _inputs(4)
    with torch.no_grad():
        ref_logits = reference(ids).logits
        assert (ours(ids) - ref_logits).abs().max().item() <= 1e-4
        save_hf(ours, tmp_path / "ours")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "ours", attn_implementation="eager"
        )
        assert (reloaded(ids).logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("null_form", [None, {}])
def test_gpt_oss_config_with_null_rope_scaling_gets_transformers_default_yarn(
    null_form, hf, tmp_path
):
    # transformers reads a null (or empty) rope_scaling as "not set": GPT-OSS's default
    # YaRN. load_hf built plain RoPE from it.
    kwargs = dict(CASES["gpt_oss_yarn_untruncated_alternating_windows_sinks"][1])
    del kwargs["rope_parameters"]  # transformers' default YaRN
    reference = hf.model("gpt_oss", seed=7, **_hf_config("gpt_oss", kwargs))
    assert reference.config.rope_parameters["rope_type"] == "yarn"
    reference.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    data = json.loads(config_path.read_text())
    data["rope_theta"] = data.pop("rope_parameters")["rope_theta"]
    data["rope_scaling"] = null_form
    config_path.write_text(json.dumps(data))
    ours = load_hf(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    ids, _ = _inputs(5)
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4


MINIMAL_CONFIGS = {  # only the fields load_hf requires, plus YaRN without its lengths
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=24,
        num_key_value_heads=2,
        num_experts=4,
        head_dim=64,
        rope_scaling={"type": "yarn", "factor": 4.0},
    ),
    "deepseek_v2": dict(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=4),
    "gpt_oss": dict(intermediate_size=24, num_key_value_heads=2, num_local_experts=4),
}


@pytest.mark.parametrize("family", sorted(MINIMAL_CONFIGS))
def test_fields_a_config_json_leaves_out_mean_what_transformers_makes_of_them(family, hf, tmp_path):
    # Our dataclass defaults differ from transformers' in a few fields (Qwen3's
    # max_position_embeddings, which YaRN reads without original_max_position_embeddings;
    # DeepSeek's q_lora_rank and n_shared_experts; GPT-OSS's head_dim): load_hf built
    # another architecture from a config.json that leaves them out.
    import transformers

    minimal = {
        "model_type": family,
        "vocab_size": VOCAB,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        **MINIMAL_CONFIGS[family],
    }
    (tmp_path / "config.json").write_text(json.dumps(minimal))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).float()
    hf.randomize(reference, seed=8)
    reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(minimal))
    ours = load_hf(tmp_path)
    ids, _ = _inputs(6)
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4


def test_qwen3_use_sliding_window_with_a_null_window_loads_as_full_attention(hf, tmp_path):
    # transformers reads use_sliding_window true with "sliding_window": null as no window;
    # load_hf refused it (sliding_window (None) must be >= 1 when use_sliding_window).
    kwargs = dict(CASES["qwen3_unnormalized_topk_sparse_step_2_tied_attention_bias_linear_rope"][1])
    reference = hf.model("qwen3_moe", seed=9, **_hf_config("qwen3_moe", kwargs))
    reference.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(use_sliding_window=True, sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours = load_hf(tmp_path)
    assert ours.config.window is None
    ids, _ = _inputs(7)
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4


def test_a_bfloat16_deepseek_saved_by_transformers_keeps_its_fp32_router_through_load_and_save(
    hf, tmp_path
):
    # transformers keeps DeepSeek-V2's gate.weight in fp32 in a bfloat16 model
    # (_keep_in_fp32_modules_strict) and saves it so; load_hf rounded it to bfloat16, so the
    # model routed otherwise than transformers' and save_hf did not give the file back.
    import transformers
    from safetensors.torch import load_file

    kwargs = CASES["deepseek_q_lora_group_limited_yarn_mscale_first_dense"][1]
    hf.model("deepseek_v2", seed=10, **_hf_config("deepseek_v2", kwargs)).save_pretrained(
        tmp_path / "fp32"
    )
    transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp32", dtype=torch.bfloat16
    ).save_pretrained(tmp_path / "hf")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    gates = [k for k in original if k.endswith("mlp.gate.weight")]
    assert gates and all(original[k].dtype == torch.float32 for k in gates)
    assert original["model.embed_tokens.weight"].dtype == torch.bfloat16

    ours = load_hf(tmp_path / "hf")
    assert all(ours.get_parameter(k).dtype == torch.float32 for k in gates)
    with torch.no_grad():
        logits = ours(_inputs(8)[0])
    assert logits.dtype == torch.bfloat16 and bool(logits.isfinite().all())
    save_hf(ours, tmp_path / "ours")
    written = load_file(tmp_path / "ours" / "model.safetensors")
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


@pytest.mark.parametrize("in_rope_dict", [True, False])
def test_a_top_level_original_max_position_embeddings_sets_yarn_as_in_transformers(
    hf, tmp_path, in_rope_dict
):
    # transformers gives a top-level original_max_position_embeddings priority over the one
    # in the YaRN dict (and over max_position_embeddings without one); load_hf ignored it and
    # ran YaRN with other frequencies.
    import transformers

    kwargs = dict(CASES["qwen3_yarn_attention_factor_window_renormalized_topk_dense_layer"][1])
    reference = hf.model("qwen3_moe", seed=11, **_hf_config("qwen3_moe", kwargs))
    reference.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["original_max_position_embeddings"] = 16
    if not in_rope_dict:
        del data["rope_parameters"]["original_max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    assert reference.config.rope_parameters["original_max_position_embeddings"] == 16
    ours = load_hf(tmp_path)
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 16
    ids, _ = _inputs(9)
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4



def test_a_top_level_original_max_position_embeddings_sets_gpt_oss_default_yarn(tmp_path):
    # With no RoPE setting, transformers' GPT-OSS model builds its default YaRN with the
    # top-level value (its config shows it only once the model is built).
    import transformers

    kwargs = dict(CASES["gpt_oss_yarn_untruncated_alternating_windows_sinks"][1])
    del kwargs["rope_parameters"]
    data = {"model_type": "gpt_oss", **_hf_config("gpt_oss", kwargs)}
    data["original_max_position_embeddings"] = 8192
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    expected = transformers.AutoModelForCausalLM.from_config(config).config.rope_parameters
    assert expected["original_max_position_embeddings"] == 8192
    scaling = config_from_hf(data).rope_scaling
    assert scaling == {k: v for k, v in expected.items() if k != "rope_theta"}


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_yarn_attention_factor_window_renormalized_topk_dense_layer",
        "qwen3_unnormalized_topk_sparse_step_2_tied_attention_bias_linear_rope",
        "gpt_oss_yarn_untruncated_alternating_windows_sinks",
    ],
)
def test_load_balancing_loss_and_its_router_gradients_match_transformers_aux_loss(
    name, hf, tmp_path
):
    # transformers' aux_loss (output_router_logits) pools every MoE layer's router
    # statistics into one Switch loss; ours, with the default load_balancing "pooled" and
    # aux_loss_type "global", must be the same number with the same router gradients.
    family, kwargs = CASES[name]
    reference = hf.model(family, seed=12, **_hf_config(family, kwargs))
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.load_balancing == "pooled" and ours.config.aux_loss_type == "global"
    ids, labels = _inputs(10)
    ref_aux = reference(ids, output_router_logits=True).aux_loss
    out = ours.loss(ids, labels)
    balance = out.losses["load_balancing_loss"]
    torch.testing.assert_close(balance, ref_aux.detach(), rtol=1e-6, atol=0)
    coef = ours.config.router_aux_loss_coef
    torch.testing.assert_close(out.aux_loss, coef * ref_aux.detach(), rtol=1e-6, atol=0)
    (coef * ref_aux).backward()
    out.aux_loss.backward()
    routers = [n for n, _ in reference.named_parameters() if re.search(r"mlp\.(gate|router)\.", n)]
    assert routers
    for key in routers:
        ref_grad, grad = reference.get_parameter(key).grad, ours.get_parameter(key).grad
        error = (grad - ref_grad).norm().item()
        assert error <= 1e-5 * ref_grad.norm().item() + 1e-12, (key, error)


# The released config.json files, scaled down but with every key they carry (the older
# rope_theta + rope_scaling spelling, keys transformers ignores such as ep_size,
# max_window_layers, experts_per_token): DeepSeek-V2 (q LoRA, 6 of 16 experts in 8 groups,
# 3 groups kept, routed weights × 16, YaRN with mscale), DeepSeek-V2-Lite (greedy),
# Qwen3-30B-A3B, and gpt-oss-20b (without its MXFP4 quantization_config).
_DEEPSEEK_V2_HUB = {
    "aux_loss_alpha": 0.003,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "kv_lora_rank": 32,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 24,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 16,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts_per_tok": 6,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 16.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "topk_group": 3,
    "topk_method": "group_limited_greedy",
    "v_head_dim": 16,
}
HUB_CONFIGS = {
    "deepseek_v2": dict(_DEEPSEEK_V2_HUB, model_type="deepseek_v2"),
    "deepseek_v2_lite": dict(
        _DEEPSEEK_V2_HUB,
        model_type="deepseek_v2",
        q_lora_rank=None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    ),
    "qwen3_30b_a3b": {
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 48,
        "intermediate_size": 64,
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "moe_intermediate_size": 24,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
    },
    "gpt_oss_20b": {
        "model_type": "gpt_oss",
        "attention_bias": True,
        "experts_per_token": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 48,
        "initial_context_length": 4096,
        "intermediate_size": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "max_position_embeddings": 131072,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 8,
        "swiglu_limit": 7.0,
    },
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_released_config_json_files_build_what_transformers_builds(name, hf, tmp_path):
    import transformers

    data = {
        **HUB_CONFIGS[name],
        "vocab_size": VOCAB,
        "num_hidden_layers": 3,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).float()
    hf.randomize(reference, seed=13)
    reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(data))  # the file as released
    ours = load_hf(tmp_path)
    ids, _ = _inputs(11)
    # Far along (YaRN's scaled frequencies matter) and, apart from GPT-OSS (whose
    # transformers code builds its masks without position_ids), two packed documents.
    far = torch.arange(3000, 3000 + SEQ_LEN)[None].expand(2, -1)
    packed = torch.cat([torch.arange(10), torch.arange(SEQ_LEN - 10)])[None].expand(2, -1)
    positions = [far] if data["model_type"] == "gpt_oss" else [far, packed]
    with torch.no_grad():
        for pos in positions:
            ref_logits = reference(ids, position_ids=pos, use_cache=False).logits
            assert (ours(ids, position_ids=pos) - ref_logits).abs().max().item() <= 1e-4
