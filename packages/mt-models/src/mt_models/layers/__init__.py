"""Shared building blocks that model families assemble into decoder layers."""

from mt_models.layers.attention import GQAAttention
from mt_models.layers.decoder import DecoderLayer
from mt_models.layers.experts import GroupedExperts, MoEBlock
from mt_models.layers.linear import Embedding, Linear
from mt_models.layers.mlp import SwiGLUMLP
from mt_models.layers.norm import RMSNorm
from mt_models.layers.rope import RotaryEmbedding
from mt_models.layers.router import RouterOutput, TopKRouter, load_balancing_loss

__all__ = [
    "DecoderLayer",
    "Embedding",
    "GQAAttention",
    "GroupedExperts",
    "Linear",
    "MoEBlock",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterOutput",
    "SwiGLUMLP",
    "TopKRouter",
    "load_balancing_loss",
]
