"""`mt-train convert` both ways, and a run that starts from a Hugging Face checkpoint."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from mt_models import build_model, deepseek_v2, gpt_oss, qwen3_moe, save_hf
from mt_train.cli import main
from mt_train.convert import parse_size
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import pretrain, setup

# Tiny configs of the three families (a few hundred kB each).
FAMILIES = {
    "qwen3_moe": dataclasses.replace(
        qwen3_moe.debug(), vocab_size=512, hidden_size=32, num_hidden_layers=2,
        moe_intermediate_size=16, intermediate_size=32,
    ),
    "deepseek_v2": dataclasses.replace(
        deepseek_v2.debug(), vocab_size=512, num_hidden_layers=2
    ),
    "gpt_oss": dataclasses.replace(
        gpt_oss.debug(), vocab_size=512, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def _hf_tensors(path):
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                out[key] = f.get_tensor(key)
    return out


def _write_hf(config, path, dtype, seed=7):
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.to(dtype)
    save_hf(model, path)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_mt_to_hf_reproduces_every_tensor_key_dtype_and_value(tmp_path, family):
    original = tmp_path / "hf"
    _write_hf(FAMILIES[family], original, torch.bfloat16)
    assert main(["convert", "hf-to-mt", "--hf", str(original), "--out", str(tmp_path / "mt")]) == 0
    assert main([
        "convert", "mt-to-hf", "--checkpoint", str(tmp_path / "mt"), "--out",
        str(tmp_path / "back"), "--max-shard-size", "40KB",
    ]) == 0
    before, after = _hf_tensors(original), _hf_tensors(tmp_path / "back")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key], tensor), key
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "40KB shards: more than one file"
    assert (tmp_path / "back" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == json.loads((original / "config.json").read_text())


def test_parse_size_reads_decimal_and_binary_units():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size("five gigs")




@pytest.mark.parametrize("source", ["hf", "mt"])
def test_a_run_starts_from_imported_weights_with_a_fresh_optimizer(tmp_path, source):
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32, seed=123)
    if source == "mt":
        assert main(["convert", "hf-to-mt", "--hf", str(tmp_path / "hf"),
                     "--out", str(tmp_path / "mt")]) == 0
    overrides = [f"run_dir={tmp_path / 'run'}", f"init_from={tmp_path / source}"]
    state = setup(resolve_config(get_recipe("tiny"), overrides=overrides))
    hf = _hf_tensors(tmp_path / "hf")
    params = state.model.canonical_parameters()
    assert sorted(params) == sorted(hf)
    for key, param in params.items():
        assert torch.equal(param.detach(), hf[key]), key
    for moments in state.optimizer.state.values():  # a fresh AdamW: zero moments, step 0
        assert all(not torch.any(t) for t in moments.values())
    assert state.step == 0


def test_init_from_a_mismatched_model_names_the_parameter_and_shapes(tmp_path):
    cfg = resolve_config(get_recipe("tiny"))
    _write_hf(cfg.model, tmp_path / "hf", torch.float32)
    overrides = ["model.hidden_size=32", f"run_dir={tmp_path / 'run'}",
                 f"init_from={tmp_path / 'hf'}"]
    with pytest.raises(ValueError, match=r"has shape .* but the model has"):
        pretrain(resolve_config(get_recipe("tiny"), overrides=overrides))
