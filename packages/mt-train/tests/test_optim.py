"""AdamW's parameter groups: weight decay on matrices only."""

import torch

from mt_models import build_model
from mt_train.optim import build_optimizer
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
