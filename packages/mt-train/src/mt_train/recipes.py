"""Recipes: named functions that return a complete `JobConfig`.

A recipe is the starting point of a run; a TOML file and ``key=value`` overrides
adjust it (`mt_train.overrides`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mt_models import deepseek_v2, gpt_oss, qwen3_moe
from mt_train.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    TrainingConfig,
)


def debug() -> JobConfig:
    """A tiny Qwen3-MoE (8 experts, top-2) on the embedded corpus; minutes on a laptop CPU."""
    return JobConfig(
        model=qwen3_moe.debug(),
        run_dir="runs/debug",
        data=DataConfig(seq_len=256),
        training=TrainingConfig(
            max_steps=150,
            global_batch_size=8,
            micro_batch_size=4,
            # 3e-3 descends faster but is chaotic at 2k tokens a step: BF16 and FP32 runs
            # part by 2% in loss; at 1e-3 BF16, FP32 and FP8 stay within 1%.
            lr=1e-3,
            warmup_steps=15,
        ),
        checkpoint=CheckpointConfig(interval=50, keep_last=2),
    )


def tiny() -> JobConfig:
    """The debug recipe shrunk to a 2-layer, 64-wide model on 64-token sequences: seconds."""
    cfg = debug()
    cfg.model = replace(
        cfg.model, hidden_size=64, num_hidden_layers=2, moe_intermediate_size=32,
        intermediate_size=64,
    )
    cfg.run_dir = "runs/tiny"
    cfg.data = replace(cfg.data, seq_len=64)
    cfg.training = replace(
        cfg.training, max_steps=20, global_batch_size=4, micro_batch_size=2, num_threads=1,
        lr=3e-3,
    )
    return cfg


def debug_deepseek_v2() -> JobConfig:
    """A tiny DeepSeek-V2 (MLA, 8 experts top-2 in 4 groups, a shared expert) on the corpus.

    Its first layer is dense; the training schedule is the `debug` recipe's.
    """
    cfg = debug()
    cfg.model = deepseek_v2.debug()
    cfg.run_dir = "runs/debug-deepseek-v2"
    return cfg


def debug_gpt_oss() -> JobConfig:
    """A tiny GPT-OSS (sinks, 64-token windows, YaRN, 8 biased experts top-2) on the corpus.

    Sliding-window and full layers alternate; the training schedule is the `debug` recipe's.
    """
    cfg = debug()
    cfg.model = gpt_oss.debug()
    cfg.run_dir = "runs/debug-gpt-oss"
    return cfg


def _full_size(model, name: str, *, lr: float) -> JobConfig:
    """The schedule shared by the full-size recipes: 4096-token sequences, 128 per step."""
    return JobConfig(
        model=model,
        run_dir=f"runs/{name}",
        data=DataConfig(seq_len=4096),
        training=TrainingConfig(
            max_steps=1000,
            global_batch_size=128,
            micro_batch_size=8,  # over all dp·ep ranks: one sequence per GPU on 8 GPUs
            lr=lr,
            warmup_steps=100,
        ),
        checkpoint=CheckpointConfig(interval=500),
    )


def qwen3_30b_a3b() -> JobConfig:
    """Qwen3-30B-A3B (128 experts, top-8) at sequence length 4096."""
    return _full_size(qwen3_moe.qwen3_30b_a3b(), "qwen3-30b-a3b", lr=3e-4)


def deepseek_v2_lite() -> JobConfig:
    """DeepSeek-V2-Lite (15.7B, 64 experts top-6 + 2 shared, MLA) at sequence length 4096.

    The peak LR 4.2e-4, AdamW betas (0.9, 0.95), weight decay 0.1 and clipping at 1.0 are
    the DeepSeek-V2 paper's for the Lite model (arXiv 2405.04434, Appendix B); the batch
    (128 sequences) and step count are a continued-pretraining run, not the paper's 5.7T
    tokens.
    """
    return _full_size(deepseek_v2.deepseek_v2_lite(), "deepseek-v2-lite", lr=4.2e-4)


def gpt_oss_20b() -> JobConfig:
    """GPT-OSS-20B (21B, 32 experts top-4, sinks, alternating 128-token windows) at 4096.

    OpenAI did not publish training hyper-parameters; these are a conservative
    continued-pretraining setting (peak LR 1e-4, the AdamW defaults of the other recipes).
    """
    return _full_size(gpt_oss.gpt_oss_20b(), "gpt-oss-20b", lr=1e-4)


RECIPES: dict[str, Callable[[], JobConfig]] = {
    "debug": debug,
    "tiny": tiny,
    "debug-deepseek-v2": debug_deepseek_v2,
    "debug-gpt-oss": debug_gpt_oss,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-v2-lite": deepseek_v2_lite,
    "gpt-oss-20b": gpt_oss_20b,
}


def get_recipe(name: str) -> JobConfig:
    """Returns the config of the recipe called `name`."""
    if name not in RECIPES:
        import difflib

        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown recipe {name!r}{hint} (recipes: {', '.join(RECIPES)})")
    return RECIPES[name]()
