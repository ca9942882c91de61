"""Shared building blocks that model families assemble into decoder layers."""

from mt_models.layers.attention import AttentionCore, GQAAttention, LocalAttention
from mt_models.layers.decoder import DecoderLayer
from mt_models.layers.experts import (
    ClampedSwiGLUExperts,
    GroupedExperts,
    MoEBlock,
    SwiGLUExperts,
)
from mt_models.layers.linear import Embedding, Linear
from mt_models.layers.mla import MLAAttention
from mt_models.layers.mlp import SwiGLUMLP
from mt_models.layers.norm import RMSNorm
from mt_models.layers.rope import RotaryEmbedding
from mt_models.layers.router import (
    RouterOutput,
    TopKRouter,
    load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
)

__all__ = [
    "AttentionCore",
    "ClampedSwiGLUExperts",
    "DecoderLayer",
    "Embedding",
    "GQAAttention",
    "GroupedExperts",
    "Linear",
    "LocalAttention",
    "MLAAttention",
    "MoEBlock",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterOutput",
    "SwiGLUExperts",
    "SwiGLUMLP",
    "TopKRouter",
    "load_balancing_loss",
    "router_z_loss",
    "sequence_load_balancing_loss",
]
