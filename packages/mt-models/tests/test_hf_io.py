"""Hub config forms, MXFP4 dequantization, dtypes and errors of load_hf / save_hf."""

import dataclasses
import json
import re
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mt_models import MODEL_FAMILIES, hf_io, load_hf, save_hf
from mt_models.deepseek_v2 import deepseek_v2, deepseek_v2_lite
from mt_models.gpt_oss import gpt_oss_20b, gpt_oss_120b
from mt_models.hf_config import config_from_hf, config_to_hf
from mt_models.mxfp4 import dequantize_mxfp4
from mt_models.qwen3_moe import qwen3_30b_a3b

pytest.importorskip("transformers")

TINY = {
    "deepseek_v2": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 16,
        },
    ),
    "gpt_oss": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
    ),
}


def _ids(vocab=64):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss"])
@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_older_rope_scaling_config_form_loads_the_same_model(family, type_key, hf, tmp_path):
    reference = hf.model(family, seed=0, **TINY[family])
    reference.save_pretrained(tmp_path)
    new_form = load_hf(tmp_path)
    hf.to_old_rope_form(tmp_path, type_key)
    data = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in data and data["rope_scaling"][type_key] == "yarn"
    old_form = load_hf(tmp_path)
    assert old_form.config == new_form.config
    with torch.no_grad():
        assert torch.equal(old_form(_ids()), new_form(_ids()))
        assert torch.allclose(old_form(_ids()), reference(_ids()).logits, rtol=0, atol=1e-4)


def _fp4_value(code: int) -> float:
    """Independent E2M1 decoding from the bits: sign, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


def test_mxfp4_dequantization_matches_bitwise_decoding_and_transformers():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 5, 2), generator=gen, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 5, 64)
    e, o, g, b = 1, 4, 1, 7
    byte, scale = int(blocks[e, o, g, b]), int(scales[e, o, g]) - 127
    assert got[e, o, g * 32 + 2 * b] == _fp4_value(byte & 0xF) * 2.0**scale
    assert got[e, o, g * 32 + 2 * b + 1] == _fp4_value(byte >> 4) * 2.0**scale
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, I, O]
    assert torch.equal(got.transpose(1, 2), expected)


def test_gpt_oss_mxfp4_expert_weights_are_dequantized_on_import(hf, tmp_path):
    reference = hf.model("gpt_oss", seed=1, **TINY["gpt_oss"])
    reference.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    expected = _to_mxfp4(tensors, seed=1)  # Hub key → [E, O, I]
    save_file(tensors, tmp_path / "model.safetensors")
    model = load_hf(tmp_path)
    params = model.canonical_parameters()
    for key, weight_EOI in expected.items():
        for e in range(weight_EOI.shape[0]):
            name = key.replace("experts.", f"experts.{e}.") + ".weight"
            assert torch.equal(params[name], weight_EOI[e]), name


def test_save_hf_keeps_bfloat16_and_transformers_loads_it_in_bfloat16(build_debug_model, tmp_path):
    import transformers

    model = build_debug_model(family="gpt_oss").to(torch.bfloat16)
    save_hf(model, tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()  # one shard
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())  # noqa: SIM118
    assert dtypes == {"BF16"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert load_hf(tmp_path).output_weight.dtype == torch.bfloat16
    assert load_hf(tmp_path, dtype=torch.float32).output_weight.dtype == torch.float32


@pytest.mark.parametrize(
    "preset", [qwen3_30b_a3b, deepseek_v2_lite, deepseek_v2, gpt_oss_20b, gpt_oss_120b]
)
def test_config_survives_hub_json_round_trip_and_plain_dict_rebuild(preset):
    config = preset()
    data = json.loads(json.dumps(config_to_hf(config, "bfloat16")))
    assert data["rope_parameters"]["rope_theta"] == data["rope_theta"] == config.rope_theta
    assert config_from_hf(data) == config
    older = {k: v for k, v in data.items() if k != "rope_parameters"}
    assert config_from_hf(older) == config
    plain = json.loads(json.dumps(dataclasses.asdict(config)))
    assert type(config)(**plain) == config


def test_gpt_oss_without_a_window_is_exported_and_read_back_with_no_windowed_layer():
    config = dataclasses.replace(gpt_oss_20b(), sliding_window=None)  # sliding layers: full
    data = json.loads(json.dumps(config_to_hf(config, "bfloat16")))
    assert data["layer_types"] == ["full_attention"] * 24  # transformers fails on a null window
    assert data["sliding_window"] == config.max_position_embeddings
    back = config_from_hf(data)
    assert [back.window(i) for i in range(24)] == [config.window(i) for i in range(24)]
    assert set(map(config.window, range(24))) == {None}
    # A null window on the Hub (an earlier export's form) is read as it was written.
    older = data | {"sliding_window": None, "layer_types": config.layer_types}
    assert config_from_hf(older) == config
    data["rms_norm_eps"] = None  # a null that cannot stay None still means the default
    assert config_from_hf(data).rms_norm_eps == config.rms_norm_eps


def test_hub_aliases_are_read():
    qwen = config_to_hf(qwen3_30b_a3b(), "bfloat16")
    qwen["num_local_experts"] = qwen.pop("num_experts")  # as transformers 5 writes it
    assert config_from_hf(qwen).num_experts == 128
    lite = config_to_hf(deepseek_v2_lite(), "bfloat16")
    lite.update(aux_loss_alpha=0.25, seq_aux=False)
    config = config_from_hf(lite)
    assert config.router_aux_loss_coef == 0.25 and config.aux_loss_type == "global"


def test_load_hf_names_missing_weights_and_unknown_families(build_debug_model, tmp_path):
    save_hf(build_debug_model(family="deepseek_v2"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.3.up_proj"):
        load_hf(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a supported family"):
        load_hf(tmp_path)
    assert set(MODEL_FAMILIES) == {"qwen3_moe", "deepseek_v2", "gpt_oss"}


_EXPERT_COUNT_FIELD = {
    "qwen3_moe": "num_experts",
    "deepseek_v2": "n_routed_experts",
    "gpt_oss": "num_local_experts",
}


@pytest.mark.parametrize("family", sorted(MODEL_FAMILIES))
def test_load_hf_key_mismatch_error_ends_with_the_config_json_fix(
    family, build_debug_model, tmp_path
):
    save_hf(build_debug_model(family=family), tmp_path)
    _edit_checkpoint(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError) as err:
        load_hf(tmp_path)
    message = str(err.value)
    assert "unexpected ['model.extra.weight']" in message
    assert f"put the config.json saved with these weights in {tmp_path}" in message
    assert message.endswith("to match the weights")
    assert "num_hidden_layers" in message and _EXPERT_COUNT_FIELD[family] in message


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_load_hf_names_the_file_and_every_required_field_config_json_lacks(
    build_debug_model, tmp_path, family
):
    save_hf(build_debug_model(family=family), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["num_attention_heads"], data["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load_hf(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "config.json") in message
    assert "lacks num_attention_heads, num_experts_per_tok" in message


def test_load_hf_names_the_index_and_the_shard_it_lists_that_is_missing(
    build_debug_model, tmp_path
):
    save_hf(build_debug_model(), tmp_path, max_shard_size=3_000_000)
    (tmp_path / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ValueError, match=r"index.json lists 1 shard.* \['model-00002-of-00004"):
        load_hf(tmp_path)


def test_load_hf_names_a_damaged_index_or_config_json(build_debug_model, tmp_path):
    # json's "Expecting value: line 1 column 1" named no file, and an index without a
    # weight_map failed as a bare KeyError('weight_map').
    save_hf(build_debug_model(), tmp_path, max_shard_size=3_000_000)
    index, config = tmp_path / hf_io.INDEX_NAME, tmp_path / "config.json"
    good_index, good_config = index.read_text(), config.read_text()
    for text, message in (
        (good_index[:40], "is not valid JSON"),
        ('{"metadata": {}}', 'has no "weight_map" object'),
        ("[]", "holds a JSON list, not an object"),
    ):
        index.write_text(text)
        with pytest.raises(ValueError, match=rf"^{index} {message}"):
            load_hf(tmp_path)
    index.write_text(good_index)
    config.write_text(good_config[:40])
    with pytest.raises(ValueError, match=rf"^{config} is not valid JSON \("):
        load_hf(tmp_path)


def test_load_hf_of_a_hub_repo_id_says_to_download_it_first(tmp_path, monkeypatch):
    # load_hf("Qwen/Qwen3-30B-A3B"), as from_pretrained takes it, raised a FileNotFoundError
    # for Qwen/Qwen3-30B-A3B/config.json that did not say load_hf reads local directories.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^Qwen/Qwen3-30B-A3B has no config.json: .* download"):
        load_hf("Qwen/Qwen3-30B-A3B")


def test_a_directory_with_both_single_file_and_index_loads_the_file_transformers_reads(
    build_debug_model, tmp_path
):
    # transformers reads model.safetensors before the index; load_hf read the index's shards,
    # so the two loaded different weights from the same directory.
    import transformers

    save_hf(build_debug_model(seed=1), tmp_path, max_shard_size=3_000_000)
    single = build_debug_model(seed=2)
    save_file(
        {k: v.contiguous() for k, v in single.canonical_parameters().items()},
        tmp_path / hf_io.SINGLE_NAME,
    )
    assert (tmp_path / hf_io.INDEX_NAME).exists()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    expected = single.model.embed_tokens.weight
    assert torch.equal(reference.model.embed_tokens.weight, expected)
    assert torch.equal(load_hf(tmp_path).model.embed_tokens.weight, expected)


def test_load_hf_refuses_a_dtype_that_is_not_a_torch_dtype(build_debug_model, tmp_path):
    # dtype="bfloat16" or "auto" (transformers' spellings) reached model.to() and failed
    # with "Invalid device string: 'bfloat16'".
    save_hf(build_debug_model(), tmp_path)
    for dtype in ("bfloat16", "auto"):
        with pytest.raises(ValueError, match=rf"dtype \('{dtype}'\) must be a torch.dtype"):
            load_hf(tmp_path, dtype=dtype)
    assert load_hf(tmp_path, dtype=torch.bfloat16).output_weight.dtype == torch.bfloat16


def test_load_hf_names_the_shard_that_is_truncated(build_debug_model, tmp_path):
    # An interrupted download leaves a short shard; safetensors' "incomplete metadata, file
    # not fully covered" did not say which of the shards it was.
    save_hf(build_debug_model(), tmp_path, max_shard_size=3_000_000)
    shard = tmp_path / "model-00003-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100_000])
    with pytest.raises(ValueError, match=rf"^{shard} is not a readable safetensors file \("):
        load_hf(tmp_path)


class _ReadTracker:
    """Wraps ``safe_open`` in ``hf_io``: counts tensor reads and the most read tensors (and
    their bytes) alive at once, each alive from its read until its tensor object is freed."""

    def __init__(self):
        self.reads, self.alive, self.alive_bytes = 0, 0, 0
        self.max_alive, self.max_alive_bytes = 0, 0

    def safe_open(self, *args, **kwargs):
        return _TrackedFile(self, safe_open(*args, **kwargs))

    def record(self, tensor):
        size = tensor.numel() * tensor.element_size()
        self.reads += 1
        self.alive += 1
        self.alive_bytes += size
        self.max_alive = max(self.max_alive, self.alive)
        self.max_alive_bytes = max(self.max_alive_bytes, self.alive_bytes)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size):
        self.alive -= 1
        self.alive_bytes -= size


class _TrackedFile:
    """A ``safe_open`` handle whose ``get_tensor`` reports to a ``_ReadTracker``."""

    def __init__(self, tracker, handle):
        self._tracker, self._handle = tracker, handle

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, key):
        return self._tracker.record(self._handle.get_tensor(key))

    def __getattr__(self, name):  # keys, get_slice, metadata: headers only
        return getattr(self._handle, name)


@pytest.fixture
def read_tracker(monkeypatch):
    """A ``_ReadTracker`` that sees every tensor ``load_hf`` reads."""
    tracker = _ReadTracker()
    monkeypatch.setattr(hf_io, "safe_open", tracker.safe_open)
    return tracker


def _stored_bytes(path):
    """Stored key → bytes of every tensor in a checkpoint directory."""
    return {
        key: tensor.numel() * tensor.element_size()
        for file in path.glob("*.safetensors")
        for key, tensor in load_file(file).items()
    }


@pytest.mark.parametrize("max_shard_size", [5 * 2**30, 200_000])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_load_hf_holds_one_checkpoint_tensor_at_a_time(
    family, max_shard_size, build_debug_model, read_tracker, tmp_path
):
    model = build_debug_model(family=family).to(torch.bfloat16)
    save_hf(model, tmp_path, max_shard_size=max_shard_size)
    sizes = _stored_bytes(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size < 2**30)
    loaded = load_hf(tmp_path)
    assert read_tracker.reads == len(sizes)  # each tensor read once
    assert read_tracker.max_alive == 1, "the whole checkpoint was held at once"
    assert read_tracker.max_alive_bytes == max(sizes.values())
    assert loaded.output_weight.dtype == torch.bfloat16  # from the embedding's header
    expected = model.canonical_parameters()
    for key, param in loaded.canonical_parameters().items():
        assert torch.equal(param, expected[key]), key


def _to_mxfp4(tensors, seed=0):
    """Replaces GPT-OSS stacked expert matrices [E, I, O] in ``tensors`` by random MXFP4
    ``_blocks`` + ``_scales``; returns Hub key → dequantized [E, O, I] (float32)."""
    gen = torch.Generator().manual_seed(seed)
    expected = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num_experts, dim_in, dim_out = tensors.pop(key).shape  # Hub layout [E, I, O]
        blocks = torch.randint(0, 256, (num_experts, dim_out, dim_in // 32, 16), generator=gen)
        scales = torch.randint(120, 128, (num_experts, dim_out, dim_in // 32), generator=gen)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks.byte(), scales.byte()
        expected[key] = dequantize_mxfp4(blocks.byte(), scales.byte(), torch.float32)
    return expected


def test_mxfp4_blocks_and_scales_in_different_shards_load_one_pair_at_a_time(
    build_debug_model, read_tracker, tmp_path
):
    save_hf(build_debug_model(family="gpt_oss"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    expected = _to_mxfp4(tensors)
    (tmp_path / "model.safetensors").unlink()
    # Every _blocks in the first shard, every _scales in the second, the rest split.
    shards = ([], [])
    for i, key in enumerate(sorted(tensors)):
        shard = {"_blocks": 0, "_scales": 1}.get(key[-len("_blocks") :], i % 2)
        shards[shard].append(key)
    assert any(k.endswith("_blocks") for k in shards[0])
    assert not any(k.endswith("_blocks") for k in shards[1])
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in keys}, tmp_path / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_hf(tmp_path)
    assert read_tracker.reads == len(tensors)
    assert read_tracker.max_alive == 2, "more than one blocks + scales pair held at once"
    params = model.canonical_parameters()
    for key, weight_EOI in expected.items():
        for e in range(weight_EOI.shape[0]):
            name = key.replace("experts.", f"experts.{e}.") + ".weight"
            assert torch.equal(params[name], weight_EOI[e]), name
    for key, tensor in tensors.items():
        if key in params:
            assert torch.equal(params[key], tensor), key


def _edit_checkpoint(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")


_DOWN = "model.layers.1.mlp.experts.down_proj"  # GPT-OSS debug: [E=8, F=96, D=128]
_MISMATCHES = {
    "stacked_experts_one_short": (
        lambda t: t.update({_DOWN: t[_DOWN][:-1]}),
        r"missing \['model.layers.1.mlp.experts.7.down_proj.weight'\] \(1 in all\)",
    ),
    "unknown_key": (
        lambda t: t.update({"model.extra.weight": torch.zeros(2)}),
        r"missing \[\] \(0 in all\), unexpected \['model.extra.weight'\] \(1 in all\)",
    ),
    # Only RoPE's inv_freq is dropped: another buffer under rotary_emb is still refused.
    "rotary_buffer_other_than_inv_freq": (
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.cos_cached": torch.zeros(2)}),
        r"unexpected \['model.layers.0.self_attn.rotary_emb.cos_cached'\]",
    ),
    "stacked_experts_wrong_hidden": (
        lambda t: t.update({_DOWN: t[_DOWN][:, :-1]}),
        r"experts.0.down_proj.weight: checkpoint shape \(128, 95\) != model shape \(128, 96\)",
    ),
    # A _scales key with no _blocks partner was dropped unread and unreported.
    "mxfp4_scales_without_blocks": (
        lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scales": torch.ones(2)}),
        r"unexpected \['model.layers.0.self_attn.o_proj.weight_scales'\]",
    ),
    "mxfp4_blocks_without_scales": (
        lambda t: t.update({_DOWN + "_blocks": torch.zeros(8, 128, 3, 16, dtype=torch.uint8)}),
        f"{_DOWN}_blocks has no matching {_DOWN}_scales",
    ),
}


@pytest.mark.parametrize("case", sorted(_MISMATCHES))
def test_load_hf_rejects_mismatched_checkpoints_from_headers_before_reading_tensors(
    case, build_debug_model, read_tracker, tmp_path
):
    edit, message = _MISMATCHES[case]
    save_hf(build_debug_model(family="gpt_oss"), tmp_path)
    _edit_checkpoint(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)
    assert read_tracker.reads == 0


def test_tied_lm_head_in_the_checkpoint_is_dropped_unread(
    build_debug_model, read_tracker, tmp_path
):
    model = build_debug_model(tie_word_embeddings=True)
    save_hf(model, tmp_path)
    _edit_checkpoint(
        tmp_path,
        lambda t: t.update(
            {"lm_head.weight": torch.full_like(t["model.embed_tokens.weight"], 7.0)}
        ),
    )
    loaded = load_hf(tmp_path)
    assert read_tracker.reads == len(model.canonical_parameters())  # all but lm_head.weight
    assert torch.equal(loaded.output_weight, model.output_weight)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_per_layer_rotary_inv_freq_buffers_of_older_hub_files_are_ignored_unread(
    family, build_debug_model, read_tracker, tmp_path
):
    # transformers before 4.3x saved RoPE's inv_freq buffer in every attention layer; its
    # values derive from config.json, and transformers drops them when loading.
    model = build_debug_model(family=family)
    save_hf(model, tmp_path)
    num_hub_tensors = len(_stored_bytes(tmp_path))
    num_layers = model.config.num_hidden_layers
    _edit_checkpoint(
        tmp_path,
        lambda t: t.update(
            {
                f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.full((4,), 9.0)
                for i in range(num_layers)
            }
        ),
    )
    loaded = load_hf(tmp_path)
    assert read_tracker.reads == num_hub_tensors  # none of the inv_freq buffers
    params = loaded.canonical_parameters()
    for key, tensor in model.canonical_parameters().items():
        assert torch.equal(params[key], tensor), key
    other = build_debug_model(seed=1, family=family)
    hf_io.load_hf_into(other, tmp_path)
    params = other.canonical_parameters()
    for key, tensor in model.canonical_parameters().items():
        assert torch.equal(params[key], tensor), key


def test_save_hf_copies_only_expert_views_and_matches_their_values(
    build_debug_model, monkeypatch, tmp_path
):
    model = build_debug_model(family="qwen3_moe")
    params = model.canonical_parameters()
    written = {}

    def capture(tensors, filename, metadata=None):
        written.update(tensors)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_io, "save_file", capture)
    save_hf(model, tmp_path, max_shard_size=100_000)
    assert sorted(written) == sorted(params)
    for key, tensor in written.items():
        is_expert = ".mlp.experts." in key
        shares = tensor.data_ptr() == params[key].data_ptr()
        assert shares != is_expert, f"{key}: copied={not shares}, expert view={is_expert}"
        assert torch.equal(tensor, params[key].detach()), key


@pytest.mark.parametrize("first_shard_size,second_shard_size", [(200_000, 2**40), (2**40, 200_000)])
def test_save_hf_over_an_earlier_save_leaves_only_the_new_weights(
    build_debug_model, tmp_path, first_shard_size, second_shard_size
):
    import transformers

    old, new = build_debug_model(seed=0), build_debug_model(seed=1)
    save_hf(old, tmp_path, max_shard_size=first_shard_size)
    save_hf(new, tmp_path, max_shard_size=second_shard_size)
    sharded = second_shard_size < 2**40
    names = sorted(p.name for p in tmp_path.glob("model*"))
    assert ("model.safetensors" in names) != sharded, names
    assert ("model.safetensors.index.json" in names) == sharded, names
    index = tmp_path / "model.safetensors.index.json"
    if sharded:
        listed = set(json.loads(index.read_text())["weight_map"].values())
        assert set(names) == listed | {index.name}, "no shard of the earlier save is left"
    key = "model.embed_tokens.weight"
    expected = new.canonical_parameters()[key]
    assert torch.equal(load_hf(tmp_path).canonical_parameters()[key], expected)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.state_dict()[key], expected)


def test_save_hf_shards_get_the_mode_of_config_json_not_0600(build_debug_model, tmp_path):
    save_hf(build_debug_model(), tmp_path, max_shard_size=2**22)
    config_mode = (tmp_path / "config.json").stat().st_mode & 0o777
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        assert shard.stat().st_mode & 0o777 == config_mode, shard.name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_load_hf_refuses_a_hidden_act_other_than_silu_instead_of_running_silu(
    build_debug_model, tmp_path, family
):
    # transformers applies ACT2FN[hidden_act] in these families' MLPs and experts; ours
    # are SiLU only, so a gelu checkpoint used to load into a different function silently.
    save_hf(build_debug_model(family=family), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for name in ("silu", "swish"):
        (tmp_path / "config.json").write_text(json.dumps({**data, "hidden_act": name}))
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**data, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match=r"hidden_act \('gelu'\) is not supported"):
        load_hf(tmp_path)


@pytest.mark.parametrize("spelling", ["top_level", "rope_parameters"])
def test_load_hf_refuses_partial_rotary_factor_in_either_spelling(
    build_debug_model, tmp_path, spelling
):
    # transformers moves a top-level partial_rotary_factor into rope_parameters and rotates
    # only part of each head; load_hf dropped the top-level one silently (full RoPE).
    save_hf(build_debug_model(), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    if spelling == "top_level":
        data["partial_rotary_factor"] = 0.5
    else:
        data["rope_parameters"]["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"partial_rotary_factor \(0.5\) is not supported"):
        load_hf(tmp_path)


def test_load_hf_refuses_a_quantized_checkpoint_it_cannot_dequantize(build_debug_model, tmp_path):
    # A block-FP8 checkpoint (Qwen/Qwen3-30B-A3B-FP8's layout: F8_E4M3 weights plus a
    # weight_scale_inv each) failed as a key mismatch whose fix was to edit num_experts and
    # friends; its quantization_config names the real cause.
    save_hf(build_debug_model(), tmp_path)
    key = "model.layers.0.mlp.experts.0.up_proj.weight"

    def to_fp8(tensors):
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)
        tensors[key + "_scale_inv"] = torch.ones(1, 1)

    _edit_checkpoint(tmp_path, to_fp8)
    data = json.loads((tmp_path / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({**data, "quantization_config": fp8}))
    with pytest.raises(ValueError) as error:
        load_hf(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "config.json") in message
    assert "quantization_config (quant_method 'fp8') is not supported for qwen3_moe" in message
    gpt_oss = config_to_hf(gpt_oss_20b(), "bfloat16")
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    assert config_from_hf({**gpt_oss, "quantization_config": mxfp4}) == gpt_oss_20b()


@pytest.mark.parametrize(
    "rope_scaling",
    [
        # Qwen3's model card: "add rope_scaling to config.json" (to a save_hf file, which
        # also writes rope_parameters)
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {"type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    ],
)
def test_a_rope_scaling_beside_rope_parameters_wins_as_in_transformers(
    build_debug_model, tmp_path, rope_scaling
):
    # transformers reads a non-empty rope_scaling in place of rope_parameters; load_hf read
    # rope_parameters and silently ran plain RoPE.
    import transformers

    save_hf(build_debug_model(), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["rope_parameters"]["rope_type"] == "default"
    (tmp_path / "config.json").write_text(json.dumps({**data, "rope_scaling": rope_scaling}))
    expected = dict(transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters)
    config = load_hf(tmp_path).config
    assert expected.pop("rope_theta") == config.rope_theta
    assert expected.pop("type", expected["rope_type"]) == expected["rope_type"]
    assert config.rope_scaling == expected


def test_deepseek_fields_transformers_ignores_but_that_change_the_model_are_refused():
    # The original DeepSeek-V2 code makes only layers with i % moe_layer_freq == 0 sparse and
    # routes by scoring_func; transformers (and load_hf) ignored both and built another model
    # (moe_layer_freq 2: a key mismatch blaming n_routed_experts and friends).
    lite = config_to_hf(deepseek_v2_lite(), "bfloat16")
    released = {"moe_layer_freq": 1, "scoring_func": "softmax"}
    assert config_from_hf({**lite, **released}) == deepseek_v2_lite()
    for key, value in (("moe_layer_freq", 2), ("scoring_func", "sigmoid")):
        with pytest.raises(ValueError, match=rf"{key} \({value!r}\) is not supported"):
            config_from_hf({**lite, **released, key: value})


def test_save_hf_refuses_a_size_string_before_touching_an_earlier_save(build_debug_model, tmp_path):
    # max_shard_size="5GB" (transformers' spelling) failed with a TypeError comparing int and
    # str, after the earlier save's weights had been deleted: the directory lost its model.
    model = build_debug_model()
    save_hf(model, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"max_shard_size \('5GB'\) must be a number of bytes"):
        save_hf(model, tmp_path, max_shard_size="5GB")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("preset", [qwen3_30b_a3b, deepseek_v2_lite, gpt_oss_20b])
def test_an_attention_dropout_other_than_zero_is_refused_not_dropped(preset):
    # transformers drops attention probabilities with config.attention_dropout while
    # training; config_from_hf dropped the field, so fine-tuning here silently ran without it.
    data = config_to_hf(preset(), "bfloat16")
    for value in (0.0, 0, None):
        assert config_from_hf({**data, "attention_dropout": value}) == preset()
    with pytest.raises(ValueError, match=r"attention_dropout \(0.1\) is not supported"):
        config_from_hf({**data, "attention_dropout": 0.1})


def test_deepseek_norm_topk_prob_true_is_refused_in_config_json_and_in_python():
    # The original DeepSeek-V2 renormalizes the top-k weights when norm_topk_prob is true
    # (and then skips routed_scaling_factor); transformers and this port ignored the field,
    # so such a config.json or DeepseekV2Config(norm_topk_prob=True) built another router.
    lite = config_to_hf(deepseek_v2_lite(), "bfloat16")
    assert config_from_hf({**lite, "norm_topk_prob": False}) == deepseek_v2_lite()
    with pytest.raises(ValueError, match=r"norm_topk_prob \(True\) is not supported"):
        config_from_hf({**lite, "norm_topk_prob": True})
    with pytest.raises(ValueError, match=r"norm_topk_prob \(True\) is not supported"):
        dataclasses.replace(deepseek_v2_lite(), norm_topk_prob=True)


@pytest.mark.parametrize("window", ["absent", 4096])
def test_qwen3_without_use_sliding_window_reads_no_window_as_transformers_does(window):
    # transformers' Qwen3MoeConfig sets sliding_window to None unless use_sliding_window;
    # config_from_hf kept 4096, so the config differed from the preset of the same model
    # (and init_from warned that sliding_window differs).
    data = config_to_hf(qwen3_30b_a3b(), "bfloat16")
    assert data["use_sliding_window"] is False
    del data["sliding_window"]
    if window != "absent":
        data["sliding_window"] = window
    assert config_from_hf(data) == qwen3_30b_a3b()


def _stored_dtypes(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", sorted(MODEL_FAMILIES))
def test_cast_to_hub_dtype_gives_each_tensor_the_dtype_transformers_saves_it_in(
    build_debug_model, tmp_path, family, dtype
):
    # transformers keeps some tensors in fp32 in a model of a lower dtype and saves them so
    # (DeepSeek-V2's router in bfloat16 and float16, GPT-OSS's norms in float16).
    import transformers

    save_hf(build_debug_model(family=family), tmp_path / "fp32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=dtype)
    reference.save_pretrained(tmp_path / "theirs")
    tensors = load_file(tmp_path / "fp32" / "model.safetensors")
    hf_io.cast_to_hub_dtype(family, tensors, dtype)
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    theirs = _stored_dtypes(tmp_path / "theirs")
    assert {k: names[t.dtype] for k, t in tensors.items()} == theirs
    assert names[dtype] in theirs.values()


def test_cast_to_hub_dtype_frees_each_tensor_before_casting_the_next_and_leaves_integers(
    monkeypatch,
):
    # A 60 GB fp32 checkpoint cast as a whole (new tensors beside the old) would need 90 GB:
    # each cast must replace its entry, the old tensor freed, before the next cast.
    # The routers are stored in bfloat16 here, so each becomes a new (fp32) tensor too.
    tensors = {
        f"model.layers.{i}.mlp.gate.weight": torch.randn(8, 4, dtype=torch.bfloat16)
        for i in range(3)
    }
    tensors["model.embed_tokens.weight"] = torch.randn(16, 4)
    tensors["counts"] = torch.arange(4)
    expected = {k: t.clone() for k, t in tensors.items()}
    alive = [weakref.ref(t) for t in tensors.values()]  # the originals, then every cast
    held_at_each_cast = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        held_at_each_cast.append(sum(ref() is not None for ref in alive))
        out = real_to(self, *args, **kwargs)
        alive.append(weakref.ref(out))
        return out

    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "to", recording_to)
        hf_io.cast_to_hub_dtype("deepseek_v2", tensors, torch.bfloat16)
    assert held_at_each_cast == [len(expected)] * 4  # the integer tensor is not cast
    counts = expected.pop("counts")
    assert tensors["counts"].dtype == torch.int64 and torch.equal(tensors["counts"], counts)
    for key, tensor in expected.items():
        want = torch.float32 if key.endswith("gate.weight") else torch.bfloat16
        assert tensors[key].dtype == want and torch.equal(tensors[key], tensor.to(want)), key


def test_a_float16_gpt_oss_export_keeps_its_fp32_norms_through_load_hf_and_saves_back_the_same(
    build_debug_model, tmp_path
):
    # mt-to-hf --dtype float16 writes GPT-OSS's RMSNorm weights in fp32, as transformers
    # does; load_hf turned only routers back to fp32 and rounded the norms to float16, so
    # saving the loaded model did not give the export back.
    model = build_debug_model(family="gpt_oss")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms off one, so that float16 would round them
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    canonical = {k: v.detach().clone() for k, v in model.canonical_parameters().items()}
    norms = {k: v.clone() for k, v in canonical.items() if k.endswith("norm.weight")}
    assert all(not torch.equal(v, v.half().float()) for v in norms.values())
    hf_io.cast_to_hub_dtype("gpt_oss", canonical, torch.float16)  # as mt-to-hf --dtype does
    hf_io.save_hf_tensors(
        "gpt_oss", model.config, canonical, tmp_path / "first", 2**30, torch.float16
    )
    assert {k for k, v in _stored_dtypes(tmp_path / "first").items() if v == "F32"} == set(norms)

    loaded = load_hf(tmp_path / "first")
    params = loaded.canonical_parameters()
    for key, norm in norms.items():
        assert params[key].dtype == torch.float32 and torch.equal(params[key], norm), key
    assert {v.dtype for k, v in params.items() if k not in norms} == {torch.float16}
    with torch.no_grad():  # the fp32 norms under float16 activations
        logits = loaded(torch.arange(16).view(2, 8))
    assert logits.dtype == torch.float16 and bool(logits.isfinite().all())
    save_hf(loaded, tmp_path / "second")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "second" / name).read_bytes() == (
            tmp_path / "first" / name
        ).read_bytes(), name


def test_load_hf_keeps_fp32_only_the_router_and_norm_weights_stored_in_fp32(
    build_debug_model, tmp_path
):
    # Routers and RMSNorms compute in fp32 whatever the activations' dtype, so any of them
    # stored in fp32 stays fp32 (not only what transformers lists); a projection stored in
    # fp32 takes the model's dtype: kept fp32 it would fail its bfloat16 matmul.
    save_hf(build_debug_model(family="qwen3_moe").to(torch.bfloat16), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    kept = ["model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.input_layernorm.weight", "model.layers.0.mlp.gate.weight"]  # fmt: skip
    cast = "model.layers.0.self_attn.o_proj.weight"
    gen = torch.Generator().manual_seed(0)
    for key in [*kept, cast]:  # fp32 values that bfloat16 cannot hold
        tensors[key] = tensors[key].float() + 1e-3 * torch.randn(tensors[key].shape, generator=gen)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded = load_hf(tmp_path)
    params = loaded.canonical_parameters()
    for key in kept:
        assert params[key].dtype == torch.float32 and torch.equal(params[key], tensors[key]), key
    assert params[cast].dtype == torch.bfloat16
    assert torch.equal(params[cast], tensors[cast].to(torch.bfloat16))
    assert {v.dtype for k, v in params.items() if k not in kept} == {torch.bfloat16}
    with torch.no_grad():
        logits = loaded(torch.arange(16).view(2, 8))
    assert logits.dtype == torch.bfloat16 and bool(logits.isfinite().all())
    # An explicit dtype is every parameter's.
    assert {p.dtype for p in load_hf(tmp_path, dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16
    }


# What transformers keeps (and saves) in fp32 in a model of a lower dtype, by family and
# dtype, written out here rather than read from hf_io.
_SAVED_FP32 = {
    ("deepseek_v2", torch.bfloat16): r"^model\.layers\.\d+\.mlp\.gate\.weight$",
    ("deepseek_v2", torch.float16): r"^model\.layers\.\d+\.mlp\.gate\.weight$",
    ("gpt_oss", torch.float16): r"^model\.(norm|layers\.\d+\.(input|post_attention)_layernorm)\.",
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", sorted(MODEL_FAMILIES))
def test_save_hf_dtype_writes_every_tensor_in_it_but_what_transformers_keeps_fp32(
    build_debug_model, tmp_path, family, dtype
):
    # save_hf wrote the model's own dtypes only; mt-train convert mt-to-hf --dtype had the
    # option (through save_hf_tensors), a model in memory did not.
    model = build_debug_model(family=family)
    with torch.no_grad():  # fp32 values that the dtype rounds, the norms included
        for param in model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    save_hf(model, tmp_path / "fp32")
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    save_hf(model, tmp_path, dtype=dtype)
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())  # untouched
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(fp32)
    kept = {k for k in fp32 if re.match(_SAVED_FP32.get((family, dtype), r"^$"), k)}
    assert bool(kept) == ((family, dtype) in _SAVED_FP32)
    for key, tensor in fp32.items():
        assert tensor.dtype == torch.float32, key
        if key in kept:
            assert written[key].dtype == torch.float32 and torch.equal(written[key], tensor), key
        else:
            assert written[key].dtype == dtype and torch.equal(written[key], tensor.to(dtype)), key
    name = str(dtype).removeprefix("torch.")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == name
    # Back in fp32 from the half model: every tensor fp32 and config.json says so.
    save_hf(load_hf(tmp_path), tmp_path / "back", dtype=torch.float32)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], v.float())
               for k, v in written.items())  # fmt: skip
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "float32"


def test_save_hf_refuses_a_dtype_it_cannot_write_before_touching_the_directory(
    build_debug_model, tmp_path
):
    model = build_debug_model(family="qwen3_moe")
    save_hf(model, tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for dtype in ("bfloat16", torch.int8, torch.float64):
        with pytest.raises(ValueError, match=rf"dtype \({re.escape(repr(dtype))}\) must be "
                           r"torch.bfloat16, torch.float16 or torch.float32, or None"):  # fmt: skip
            save_hf(model, tmp_path, dtype=dtype)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_load_hf_into_fills_the_materialized_layers_and_skips_those_left_on_meta(
    build_debug_model, tmp_path, monkeypatch
):
    # A pipeline rank materializes its own stages only: the rest stays on the meta device,
    # and the Hub tensors that only fill it are not read.
    source = build_debug_model(family="deepseek_v2")
    save_hf(source, tmp_path)
    with torch.device("meta"):
        model = type(source)(source.config)
    model.model.layers[1].to_empty(device="cpu")
    read = []
    original = hf_io._read_hub_tensor
    monkeypatch.setattr(hf_io, "_read_hub_tensor",
                        lambda tensor, *a: read.append(tensor.key) or original(tensor, *a))
    hf_io.load_hf_into(model, tmp_path)
    assert read and all(key.startswith("model.layers.1.") for key in read), read
    want = dict(source.named_parameters())
    loaded = [name for name, p in model.named_parameters() if not p.is_meta]
    assert loaded and all(name.startswith("model.layers.1.") for name in loaded)
    for name in loaded:
        assert torch.equal(model.get_parameter(name), want[name]), name
    assert model.model.embed_tokens.weight.is_meta and model.model.layers[0].self_attn is not None
