"""Fixtures: debug models of every family (built on meta, materialized on CPU, initialized),
and helpers that build tiny random Hugging Face models to compare against."""

import dataclasses
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mt_models import build_model

FAMILIES = ("qwen3_moe", "deepseek_v2", "gpt_oss")


def _build(seed: int = 0, family: str = "qwen3_moe", **overrides):
    config = dataclasses.replace(
        importlib.import_module(f"mt_models.{family}").debug(), **overrides
    )
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.fixture
def build_debug_model():
    """Returns ``build(seed=0, family="qwen3_moe", **config_overrides)`` → an initialized
    fp32 CPU model of that family's debug preset."""
    return _build


def _randomize(model, seed: int = 0) -> None:
    """Every parameter random (norms around 1), so biases, sinks and norms all matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)


def _hf_model(family: str, seed: int = 0, **kwargs):
    """A tiny fp32 transformers model of ``family`` with random weights (eager attention)."""
    import transformers

    config_cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "gpt_oss": transformers.GptOssConfig,
    }[family]
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    _randomize(model, seed)
    return model


def _to_old_rope_form(path: Path, type_key: str = "type") -> None:
    """Rewrites a saved config.json from ``rope_parameters`` to ``rope_theta`` + ``rope_scaling``
    (how older Hub checkpoints spell it)."""
    config_path = Path(path) / "config.json"
    data = json.loads(config_path.read_text())
    params = dict(data.pop("rope_parameters"))
    data["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", "default")
    data["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **params}
    config_path.write_text(json.dumps(data))


@pytest.fixture
def hf():
    """Helpers: ``model(family, seed, **config)``, ``randomize(model, seed)``,
    ``to_old_rope_form(path)``."""
    return SimpleNamespace(
        model=_hf_model, randomize=_randomize, to_old_rope_form=_to_old_rope_form
    )
