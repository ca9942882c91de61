"""Validation shared by the family configs (typed dataclasses with Hub field names).

Besides the Hub's fields, every family config carries the training-only router-loss
switches (not written to a Hub ``config.json``): ``router_aux_loss_coef`` (a Hub field of
Qwen3-MoE and GPT-OSS), ``aux_loss_type``, ``load_balancing`` and ``router_z_loss_coef``.
"""

import dataclasses
import math
from typing import Any

AUX_LOSS_TYPES = ("global", "sequence")
# How the layers' balancing losses combine, as the family's Hub code does (so a Hub
# coefficient keeps its meaning): "pooled" computes one loss from the statistics of all
# layers together (transformers' load_balancing_loss_func: Qwen3-MoE, GPT-OSS); "per_layer"
# sums per-layer losses each normalized to 1 for uniform routing (DeepSeek-V2's MoEGate,
# Megatron-Core).
LOAD_BALANCING = ("pooled", "per_layer")

# Our fields that are not Hub config.json keys; save_hf leaves them out.
TRAINING_ONLY_FIELDS = ("aux_loss_type", "load_balancing", "router_z_loss_coef")


def check_finite(config: Any) -> None:
    """Raises ValueError naming the first float field that is NaN or infinite: the range
    checks read ``value <= 0``, which NaN passes, and infinity is no JSON number."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"{f.name} ({value}) must be a finite number (NaN and infinity are refused)"
            )


def check_positive(config: Any, names: list[str]) -> None:
    """Raises ValueError naming the first field in ``names`` that is below 1."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")


def check_router_losses(config: Any) -> None:
    """Validates ``router_aux_loss_coef``, ``aux_loss_type``, ``load_balancing`` and
    ``router_z_loss_coef``."""
    if config.aux_loss_type not in AUX_LOSS_TYPES:
        raise ValueError(
            f"aux_loss_type ({config.aux_loss_type!r}) must be one of {AUX_LOSS_TYPES}: "
            "'global' balances the whole batch, 'sequence' each sequence"
        )
    if config.load_balancing not in LOAD_BALANCING:
        raise ValueError(
            f"load_balancing ({config.load_balancing!r}) must be one of {LOAD_BALANCING}: "
            "'pooled' is one loss over all layers' statistics (transformers), 'per_layer' "
            "the sum of per-layer losses normalized to 1 (DeepSeek-V2, Megatron-Core)"
        )
    if config.router_aux_loss_coef < 0 or config.router_z_loss_coef < 0:
        raise ValueError(
            f"router_aux_loss_coef ({config.router_aux_loss_coef}) and router_z_loss_coef "
            f"({config.router_z_loss_coef}) must be >= 0 (0 switches the loss off)"
        )


# The numeric keys of rope_scaling that mt_models.layers.rope reads.
_ROPE_SCALING_NUMBERS = (
    "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
    "mscale", "mscale_all_dim",
)  # fmt: skip


def check_rope(config: Any) -> None:
    """Validates ``rope_theta``, ``rms_norm_eps`` and ``rope_scaling`` (its type, numbers
    where RoPE reads numbers, a bool ``truncate``, and a ``factor`` > 0, required by
    ``linear``: a factor of 0 makes every RoPE angle NaN); spells the type key ``rope_type``
    (older Hub files say ``type``)."""
    from mt_models.layers.rope import rope_type_of

    if config.rope_scaling and "type" in config.rope_scaling:
        scaling = dict(config.rope_scaling)
        scaling.setdefault("rope_type", scaling.pop("type"))
        scaling.pop("type", None)
        config.rope_scaling = scaling
    if config.rope_theta <= 0 or config.rms_norm_eps <= 0:
        raise ValueError(
            f"rope_theta ({config.rope_theta}) and rms_norm_eps ({config.rms_norm_eps}) must be > 0"
        )
    rope_type = rope_type_of(config.rope_scaling)
    if rope_type == "default":
        return
    for name in _ROPE_SCALING_NUMBERS:  # a string from a config file failed later as TypeError
        value = config.rope_scaling.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"rope_scaling {name} ({value!r}) must be a number")
        if value is not None and not math.isfinite(value):  # NaN passes the checks below
            raise ValueError(
                f"rope_scaling {name} ({value}) must be a finite number (NaN and infinity "
                "are refused)"
            )
    truncate = config.rope_scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"rope_scaling truncate ({truncate!r}) must be true or false")
    factor = config.rope_scaling.get("factor")
    if factor is None and rope_type == "linear":
        raise ValueError(
            "rope_scaling of type 'linear' needs a 'factor' (the context extension, e.g. 2.0)"
        )
    if factor is not None and not factor > 0:
        raise ValueError(
            f"rope_scaling factor ({factor}) must be > 0 (the context extension, usually >= 1)"
        )
    original = config.rope_scaling.get("original_max_position_embeddings")
    if original is not None and original < 1:
        raise ValueError(
            f"rope_scaling original_max_position_embeddings ({original}) must be >= 1 or absent"
        )
