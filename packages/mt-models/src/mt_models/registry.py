"""Family name → (config class, model class), and ``build_model``."""

from mt_models.base import CausalLM
from mt_models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from mt_models.gpt_oss import GptOssConfig, GptOssForCausalLM
from mt_models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

# Family name (the Hub's ``model_type``) → (config class, model class).
MODEL_FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
}


def build_model(config) -> CausalLM:
    """Builds the model of the family whose config class ``config`` is.

    Shapes only: call ``init_weights(seed)`` afterwards (after ``to_empty`` when built under
    ``torch.device("meta")``).

    Args:
        config: A config instance of a family in ``MODEL_FAMILIES``.

    Returns:
        The model.
    """
    for config_cls, model_cls in MODEL_FAMILIES.values():
        if type(config) is config_cls:
            return model_cls(config)
    known = ", ".join(cls.__name__ for cls, _ in MODEL_FAMILIES.values())
    raise ValueError(
        f"config of type {type(config).__name__} belongs to no model family; pass one of: {known}"
    )
