"""FLOP and parameter accounting per family, checked against hand counts and published sizes."""

import pytest
import torch

from mt_models import build_model
from mt_models.deepseek_v2 import deepseek_v2, deepseek_v2_lite
from mt_models.gpt_oss import gpt_oss_20b, gpt_oss_120b
from mt_models.qwen3_moe import qwen3_30b_a3b, qwen3_235b_a22b


@pytest.mark.parametrize(
    ("preset", "total", "active_without_embedding"),
    [
        (qwen3_30b_a3b, 30.5e9, 3.3e9 - 0.31e9),
        (qwen3_235b_a22b, 235.1e9, 22.2e9 - 0.62e9),
        (deepseek_v2_lite, 15.7e9, 2.4e9),
        (deepseek_v2, 236e9, 21e9),
        (gpt_oss_20b, 20.9e9, 3.61e9),
        (gpt_oss_120b, 116.8e9, 5.13e9),
    ],
)
def test_presets_have_the_published_parameter_counts(preset, total, active_without_embedding):
    with torch.device("meta"):
        model = build_model(preset())
    num_total, num_active = model.parameter_counts()
    embedding = model.model.embed_tokens.weight.numel()
    assert abs(num_total - total) / total < 0.01
    assert abs(num_active - embedding - active_without_embedding) / active_without_embedding < 0.04


def test_deepseek_flops_match_hand_count_with_mla_head_dims(build_debug_model):
    model = build_debug_model(family="deepseek_v2")  # D 128, H 4, Dn 32, Dr 16, Dv 32
    seq_len = 64
    attn = 128 * 96 + 96 * 4 * 48 + 128 * (64 + 16) + 64 * 4 * (32 + 32) + 4 * 32 * 128
    scores = 2 * 4 * (48 + 32) * seq_len / 2  # d_qk = 48 ≠ d_v = 32
    dense_mlp = 3 * 128 * 256
    moe = 128 * 8 + 2 * 3 * 128 * 64 + 3 * 128 * 64  # router, top-2 experts, one shared
    head = 128 * 4096
    forward = 2 * (3 * attn + dense_mlp + 2 * moe + head) + 3 * scores
    assert model.flops_per_token(seq_len) == pytest.approx(3 * forward)


def test_gpt_oss_flops_count_windowed_layers_by_their_window(build_debug_model):
    model = build_debug_model(family="gpt_oss")  # 4 layers, window 64 on layers 0 and 2
    seq_len = 256
    attn = 128 * 32 * (4 + 2 + 2 + 4)
    moe = 128 * 8 + 2 * (128 * 192 + 96 * 128)  # router, top-2 of gate_up and down
    full = 2 * 4 * 64 * seq_len / 2
    windowed = 2 * 4 * 64 * (64 - 64 * 64 / (2 * seq_len))  # ∫ min(x, 64) dx / S
    forward = 2 * (4 * (attn + moe) + 128 * 4096) + 2 * full + 2 * windowed
    assert model.flops_per_token(seq_len) == pytest.approx(3 * forward)
    # The window saves attention FLOPs only once the sequence is longer than it.
    assert model.flops_per_token(64) == pytest.approx(
        3 * (2 * (4 * (attn + moe) + 128 * 4096) + 4 * 2 * 4 * 64 * 32)
    )


def test_active_parameters_count_k_of_e_experts(build_debug_model):
    model = build_debug_model(family="gpt_oss")
    total, active = model.parameter_counts()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total == sum(p.numel() for p in model.parameters())
    assert active == total - experts * 6 // 8
