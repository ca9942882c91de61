"""The `mt-train` surface is a short, deliberate list: adding to it must edit this test."""

import argparse

from mt_train.cli import build_parser
from mt_train.overrides import flatten
from mt_train.recipes import RECIPES, get_recipe

TOP_LEVEL_KEYS = [
    "checkpoint", "data", "init_from", "log_every", "metrics", "model", "model_family",
    "parallel", "precision", "profile", "run_dir", "seed", "training", "validation",
]
NON_MODEL_KEYS = sorted([
    "checkpoint.async_save", "checkpoint.interval", "checkpoint.keep_last", "checkpoint.resume",
    "data.document_masking", "data.on_exhausted", "data.path", "data.seq_len",
    "init_from", "log_every", "model_family", "run_dir", "seed",
    "metrics.tensorboard", "metrics.wandb_project",
    "parallel.cp", "parallel.dp", "parallel.ep", "parallel.ep_comm", "parallel.grad_reduce",
    "parallel.pp",
    "parallel.reshard_after_forward", "parallel.timeout_s", "precision.fp8",
    "profile.memory_snapshot", "profile.nvtx", "profile.trace_steps",
    "training.beta1", "training.beta2", "training.device", "training.dtype", "training.eps",
    "training.global_batch_size", "training.grad_clip", "training.lr",
    "training.max_steps", "training.micro_batch_size", "training.min_lr_ratio",
    "training.num_threads", "training.on_nonfinite", "training.warmup_steps",
    "training.weight_decay",
    "validation.interval", "validation.path", "validation.steps",
])


def _subcommands(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_config_keys_are_the_pinned_list():
    data = get_recipe("debug").to_dict()
    assert sorted(data) == TOP_LEVEL_KEYS
    keys = sorted(k for k in flatten(data) if not k.startswith("model."))
    assert keys == NON_MODEL_KEYS


def test_subcommands_and_recipes_are_the_pinned_list():
    commands = _subcommands(build_parser())
    assert sorted(commands) == ["convert", "generate", "pretrain"]
    assert sorted(_subcommands(commands["convert"])) == ["hf-to-mt", "mt-to-hf"]
    assert sorted(RECIPES) == [
        "debug", "debug-deepseek-v2", "debug-gpt-oss", "deepseek-v2-lite", "gpt-oss-20b",
        "qwen3-30b-a3b", "tiny",
    ]
    for name in RECIPES:  # every recipe builds a valid config
        assert get_recipe(name).training.max_steps >= 1
