"""AdamW's parameter groups (weight decay on matrices only) and the LR schedule."""

import dataclasses
import math

import pytest
import torch

from mt_models import build_model
from mt_train.optim import build_optimizer, lr_at
from mt_train.recipes import get_recipe


def test_weight_decay_skips_norms_and_biases_including_gpt_oss_expert_biases():
    cfg = get_recipe("debug-gpt-oss")
    with torch.device("meta"):
        model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.training)
    decay_of = {
        id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]
    }
    names = dict(model.named_parameters())
    expert_biases = [n for n, p in names.items() if "experts" in n and n.endswith("bias")]
    assert expert_biases and all(names[n].ndim == 2 for n in expert_biases)
    for name, param in names.items():
        matrix = param.ndim >= 2 and not name.endswith("bias")
        expected = cfg.training.weight_decay if matrix else 0.0
        assert decay_of[id(param)] == expected, (name, tuple(param.shape))


def test_without_warmup_the_cosine_decay_starts_at_step_1_and_is_flat_only_at_min_lr_ratio_1():
    cfg = dataclasses.replace(get_recipe("tiny").training, warmup_steps=0, max_steps=10)
    lrs = [lr_at(step, cfg) for step in range(1, 11)]
    assert lrs[0] < cfg.lr and lrs[0] == pytest.approx(
        cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi / 10)))
    )
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    flat = dataclasses.replace(cfg, min_lr_ratio=1.0)
    assert {lr_at(step, flat) for step in range(1, 11)} == {cfg.lr}
