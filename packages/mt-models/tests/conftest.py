"""Fixtures: the debug Qwen3-MoE built on meta, materialized on CPU and initialized."""

import dataclasses

import pytest
import torch

from mt_models import Qwen3MoeForCausalLM
from mt_models.qwen3_moe import debug


def _build(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    config = dataclasses.replace(debug(), **overrides)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.fixture
def build_debug_model():
    """Returns ``build(seed=0, **config_overrides)`` → an initialized fp32 CPU model."""
    return _build
