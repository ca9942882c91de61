"""mt-models: mixture-of-experts model families in plain PyTorch behind a five-phase
layer protocol (attend, dispatch, experts, combine, aggregate). No process groups,
ranks or collectives: the one contact with ``torch.distributed`` is ``CausalLM`` recognizing
FSDP2's DTensor shards (``base.py``), so ``init_weights`` initializes a sharded model and
``to_canonical`` names this rank's experts without gathering them."""

from mt_models.base import CausalLM, LossOutput
from mt_models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from mt_models.dispatch import LocalDispatcher, LocalRoute
from mt_models.gpt_oss import GptOssConfig, GptOssForCausalLM
from mt_models.hf_io import load_hf, load_hf_into, save_hf, save_hf_tensors
from mt_models.layers.attention import AttentionCore, LocalAttention
from mt_models.protocol import Dispatcher, LayerOutput, MoEDecoderLayer, Routed, RouterStats
from mt_models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mt_models.registry import MODEL_FAMILIES, build_model

__all__ = [
    "MODEL_FAMILIES",
    "AttentionCore",
    "CausalLM",
    "DeepseekV2Config",
    "DeepseekV2ForCausalLM",
    "Dispatcher",
    "GptOssConfig",
    "GptOssForCausalLM",
    "LayerOutput",
    "LocalAttention",
    "LocalDispatcher",
    "LocalRoute",
    "LossOutput",
    "MoEDecoderLayer",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Routed",
    "RouterStats",
    "build_model",
    "load_hf",
    "load_hf_into",
    "save_hf",
    "save_hf_tensors",
]
