"""`precision.fp8=true` on CPU (mt-ops' exact FP8 emulation): the run trains through FP8
linears, each weight is quantized once per optimizer step from the weight of that step
(also under FSDP2 with expert parallelism: FSDP2's gathered weights keep their version
counter, so only the step's invalidation keeps the cache fresh), checkpoints keep
the Hub's per-expert keys, and a resumed FP8 run continues bit for bit."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mt_data.default_corpus import default_corpus_dir
from mt_models import build_model
from mt_ops import FP8GroupedLinear, FP8Linear
from mt_ops.fp8_linear import quantize_weight
from mt_train import train as train_module
from mt_train.config import JobConfig
from mt_train.overrides import resolve_config
from mt_train.precision import apply_fp8, check_fp8_device
from mt_train.recipes import get_recipe
from mt_train.train import next_microbatches, pretrain, setup, train_step, validate

# Constant LR, so a run stopped early and resumed has the uninterrupted run's schedule.
CONSTANT_LR = ["training.warmup_steps=0", "training.min_lr_ratio=1.0"]


def _cfg(run_dir, *overrides):
    return resolve_config(
        get_recipe("tiny"), overrides=[f"run_dir={run_dir}", "precision.fp8=true", *overrides]
    )


def _fp8_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear | FP8GroupedLinear)}


def _record_quantizations(cache, param_of_module):
    """Wraps ``cache.get``: the quantizations served for ``param_of_module()``'s weight."""
    served, get = [], cache.get

    def recording_get(weight):
        quantized = get(weight)
        if weight is param_of_module():
            served.append(quantized.blocks)
        return quantized

    cache.get = recording_get
    return served


def _equal(a, b):
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(
        a.scale, b.scale
    )


def test_fp8_run_trains_through_fp8_linears_quantizing_each_weight_once_per_step(tmp_path):
    cfg = _cfg(tmp_path, "training.max_steps=20", "training.warmup_steps=3")
    state = setup(cfg)
    fp8 = _fp8_modules(state.model)
    # Attention projections and experts convert; the head (and router, norms) stay.
    assert "model.layers.0.self_attn.q_proj" in fp8 and "lm_head" not in fp8
    assert "model.layers.1.mlp.experts.down_proj" in fp8 and len(fp8) == 2 * 7
    assert all(m.weight_cache is state.fp8_cache for m in fp8.values())
    experts = state.model.model.layers[0].mlp.experts
    served = _record_quantizations(state.fp8_cache, lambda: experts.gate_proj.weight)
    losses = []
    for step in range(1, cfg.training.max_steps + 1):
        before = experts.gate_proj.weight.detach().clone()
        losses.append(train_step(state, next_microbatches(state))["loss"])
        # Two micro-batches, one quantization per weight; then the cache was emptied.
        assert state.fp8_cache.num_quantizations == step * len(fp8) and not state.fp8_cache
        # Both micro-batches (whose backward reuses their forward's) got this step's weight.
        assert len(served) == 2 * step
        assert all(_equal(q, quantize_weight(before).blocks) for q in served[-2:]), step
    assert not _equal(served[0], served[-1]), "the weights moved: the quantization must too"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    # Checkpoints keep one Hub key per expert (FP8GroupedLinear is a GroupedLinear).
    keys = state.model.canonical_parameters()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_proj.weight" not in keys


def test_fp8_run_resumed_from_a_checkpoint_continues_bit_exactly(tmp_path):
    whole = pretrain(_cfg(tmp_path / "whole", "training.max_steps=6", *CONSTANT_LR))
    pretrain(_cfg(tmp_path / "split", "training.max_steps=3", *CONSTANT_LR))
    resumed = pretrain(_cfg(tmp_path / "split", "training.max_steps=6", *CONSTANT_LR))
    assert resumed.step == 6 and len(resumed.losses) == 3
    assert resumed.losses == whole.losses[3:]
    assert _fp8_modules(resumed.model)


def test_fp8_validation_and_a_skipped_step_use_the_quantization_of_the_current_weights(
    tmp_path, monkeypatch
):
    cfg = _cfg(
        tmp_path, "training.max_steps=3", f"validation.path={default_corpus_dir()}",
        "validation.interval=1",
    )  # fmt: skip
    state = setup(cfg)
    cache, num_fp8 = state.fp8_cache, len(_fp8_modules(state.model))
    experts = state.model.model.layers[0].mlp.experts
    served = _record_quantizations(cache, lambda: experts.gate_proj.weight)
    train_step(state, next_microbatches(state))
    # Validation (no_grad, after the step) quantizes the updated weights afresh...
    updated = quantize_weight(experts.gate_proj.weight).blocks
    served.clear()
    validate(state)
    assert served and all(_equal(q, updated) for q in served)
    assert cache.num_quantizations == 2 * num_fp8
    # ...and a step skipped for a NaN gradient reuses them (the weights did not move),
    # then leaves the cache empty like any step.
    real_clip = train_module.clip_grad_norm

    def clip_with_a_nan_gradient(params, max_norm, group):
        params = list(params)
        params[0].grad.view(-1)[0] = float("nan")
        return real_clip(params, max_norm, group)

    monkeypatch.setattr(train_module, "clip_grad_norm", clip_with_a_nan_gradient)
    served.clear()
    train_step(state, next_microbatches(state))
    assert state.skipped_steps == 1 and not cache
    assert served and all(_equal(q, updated) for q in served)
    assert cache.num_quantizations == 2 * num_fp8
    assert _equal(quantize_weight(experts.gate_proj.weight).blocks, updated)


# Run by each of two torchrun ranks (gloo): expert parallelism (each rank holds 4 of the 8
# experts, as FP8 modules) and FSDP2 over both ranks for the rest. Every quantization a
# step serves is that of the step's full weight. Without `train_step`'s invalidation step 2
# would be served step 1's: FSDP2 refills the gathered weight with its version counter
# preserved.
_FSDP_RANK = """
import sys, torch
sys.path.insert(0, {here!r})
from test_fp8 import _cfg, _equal, _record_quantizations
from mt_ops import FP8GroupedLinear, FP8Linear
from mt_ops.fp8_linear import quantize_weight
from mt_train.train import next_microbatches, setup, train_step

state = setup(_cfg({run_dir!r}, "training.max_steps=3", "parallel.ep=2"))
layer = state.model.model.layers[1]
assert isinstance(layer.self_attn.o_proj, FP8Linear)
assert isinstance(layer.mlp.experts.down_proj, FP8GroupedLinear)
assert layer.mlp.experts.down_proj.num_experts == 4
served = _record_quantizations(state.fp8_cache, lambda: layer.self_attn.o_proj.weight)
previous = None
for _ in range(3):
    full = layer.self_attn.o_proj.weight.full_tensor()  # the sharded master weight
    expected = quantize_weight(full).blocks
    served.clear()
    train_step(state, next_microbatches(state))
    assert served and all(_equal(q, expected) for q in served), f"step {{state.step}}"
    assert previous is None or not _equal(expected, previous)
    previous = expected
"""


def test_fp8_under_fsdp_and_ep_quantizes_the_gathered_weight_of_every_step(tmp_path):
    script = tmp_path / "rank.py"
    here = str(Path(__file__).parent)
    script.write_text(_FSDP_RANK.format(here=here, run_dir=str(tmp_path / "run")))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(script),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_fp8_needs_fp8_tensor_cores_and_an_eligible_linear(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100 has 8.0.*fp8=false"):
        check_fp8_device(torch.device("cuda", 0))
    tiny = get_recipe("tiny").model
    odd = replace(tiny, hidden_size=40, head_dim=20, moe_intermediate_size=24, intermediate_size=24)
    with torch.device("meta"):
        model = build_model(odd)
    with pytest.raises(ValueError, match="no linear layer to run in FP8.*multiples of 16"):
        apply_fp8(model, torch.device("cpu"))


def test_precision_section_parses_and_old_configs_default_to_bf16():
    cfg = resolve_config(get_recipe("debug"), overrides=["precision.fp8=true"])
    assert cfg.precision.fp8 is True and get_recipe("debug").precision.fp8 is False
    old = cfg.to_dict()
    del old["precision"]  # a checkpoint written before the section existed
    assert JobConfig.from_dict(old).precision.fp8 is False
