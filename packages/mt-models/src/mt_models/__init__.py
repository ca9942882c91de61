"""mt-models: mixture-of-experts model families in plain PyTorch behind a five-phase
layer protocol (attend, dispatch, experts, combine, aggregate). No distributed code."""

from mt_models.base import CausalLM, LossOutput
from mt_models.dispatch import LocalDispatcher
from mt_models.protocol import Dispatcher, LayerOutput, MoEDecoderLayer, Routed, RouterStats
from mt_models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

# Family name → (config class, model class).
MODEL_FAMILIES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}


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


__all__ = [
    "MODEL_FAMILIES",
    "CausalLM",
    "Dispatcher",
    "LayerOutput",
    "LocalDispatcher",
    "LossOutput",
    "MoEDecoderLayer",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Routed",
    "RouterStats",
    "build_model",
]
