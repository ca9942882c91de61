"""The single-GPU code paths of the parallel stack: NCCL with one rank, CUDA tensors.

Run under TORCH_CUDA_SANITIZER=1 on the GPU machine to catch stream races. Multi-GPU
layouts are checked by the multi-GPU issue's runs.
"""

from dataclasses import replace

import pytest

from mt_models import deepseek_v2, gpt_oss, qwen3_moe
from mt_parallel.testing import check_many, spawn

pytestmark = pytest.mark.gpu

SHAPES = {"seq_len": 64, "global_batch": 4, "micro_batch": 2, "steps": 3, "seed": 1}


def test_one_gpu_nccl_run_with_the_expert_parallel_dispatcher_matches_plain_pytorch():
    """Asynchronous all-to-alls on the side stream (the default)."""
    cases = [
        (replace(qwen3_moe.debug(), num_hidden_layers=2), [{}]),
        (replace(deepseek_v2.debug(), num_hidden_layers=2), [{}]),
        (
            replace(
                gpt_oss.debug(), num_hidden_layers=2, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
            [{}],
        ),
    ]
    spawn(
        check_many, 1, cases, backend="nccl", device="cuda", force_expert_parallel=True,
        **SHAPES,
    )


def test_synchronous_expert_parallel_dispatch_on_one_gpu_matches_plain_pytorch():
    cases = [(replace(qwen3_moe.debug(), num_hidden_layers=2), [{}])]
    spawn(
        check_many, 1, cases, backend="nccl", device="cuda", force_expert_parallel=True,
        ep_async=False, **SHAPES,
    )
