"""Hub ``config.json`` ↔ family config dataclasses.

Reads both RoPE spellings: the current ``rope_parameters`` dict (with ``rope_theta`` and
``rope_type`` inside) and the older top-level ``rope_theta`` plus ``rope_scaling`` (whose
type key may be ``type`` or ``rope_type``); a non-empty ``rope_scaling`` wins over
``rope_parameters``, as in transformers, and a top-level ``original_max_position_embeddings``
wins over YaRN's own. Writes both (they agree). Keys the family does not use
(``bos_token_id``, ``use_cache``, ...) are dropped on import; a few Hub aliases are mapped
(Qwen3's ``num_local_experts`` as written by transformers 5; DeepSeek's ``aux_loss_alpha``
and ``seq_aux``). A field the file leaves out means what transformers
makes of it (``HF_ABSENT_DEFAULTS`` where our dataclass defaults differ). A ``hidden_act``
other than SiLU (Qwen3-MoE, DeepSeek-V2) is refused: dropping it would load the weights
into a different function. An ``attention_dropout`` other than 0 is refused (transformers
trains with it; these models have no dropout). A ``quantization_config`` is refused unless
it is GPT-OSS's MXFP4 (dequantized on import): other methods store scales beside the
weights that ``load_hf`` does not apply. A DeepSeek-V2 ``moe_layer_freq`` other than 1 or
``scoring_func`` other than softmax is refused too (transformers ignores both; the original
code does not).
"""

import dataclasses
import typing
from typing import Any

from mt_models.configs import TRAINING_ONLY_FIELDS
from mt_models.layers.rope import rope_type_of
from mt_models.registry import MODEL_FAMILIES

# transformers' RoPE base when a config.json names none.
DEFAULT_ROPE_THETA = {"qwen3_moe": 10000.0, "deepseek_v2": 10000.0, "gpt_oss": 150000.0}

# Families whose transformers MLPs and experts apply ``ACT2FN[config.hidden_act]``; ours
# are SwiGLU (SiLU) only. GPT-OSS's transformers code ignores ``hidden_act`` (its experts
# are the clamped SwiGLU of ``swiglu_alpha``/``swiglu_limit``).
_HIDDEN_ACT_FAMILIES = ("qwen3_moe", "deepseek_v2")
# ACT2FN names of SiLU.
_SILU_NAMES = ("silu", "swish")

# DeepSeek-V2 config.json fields of the original (trust_remote_code) model that
# transformers' port ignores, and the one value each that both builds: every layer from
# first_k_dense_replace on is sparse (the original also needs layer % moe_layer_freq == 0),
# and routing is softmax. Any other value describes another architecture.
_DEEPSEEK_FIXED = {"moe_layer_freq": 1, "scoring_func": "softmax"}

# quantization_config quant_method that load_hf dequantizes, per family (hf_io, mxfp4.py).
_DEQUANTIZED = {"gpt_oss": ("mxfp4",)}

# transformers' values of fields a config.json may leave out, where our dataclass defaults
# (for Python callers and presets) differ: an absent field means what transformers makes of
# it. (A null head_dim is derived, hidden_size // num_attention_heads, as transformers does.)
HF_ABSENT_DEFAULTS = {
    "qwen3_moe": {"max_position_embeddings": 32768, "sliding_window": 4096},
    "deepseek_v2": {"q_lora_rank": 1536, "n_shared_experts": 2},
    "gpt_oss": {"head_dim": 64},
}

# Family name → the transformers architecture class that loads it.
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def family_of_hf_config(data: dict[str, Any]) -> str:
    """The family name of a Hub config dict (its ``model_type``).

    Args:
        data: The parsed ``config.json``.

    Returns:
        A key of ``MODEL_FAMILIES``.
    """
    model_type = data.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ValueError(
            f"config.json model_type ({model_type!r}) is not a supported family; "
            f"supported: {sorted(MODEL_FAMILIES)}"
        )
    return model_type


def _split_rope(data: dict[str, Any]) -> tuple[float | None, dict | None, bool]:
    """``(rope_theta, rope_scaling, found)`` from either spelling, as transformers picks:
    a non-empty ``rope_scaling`` wins over ``rope_parameters`` (a model card's "add
    rope_scaling to config.json" applies to a file that also has ``rope_parameters``)."""
    scaling = data.get("rope_scaling")
    if scaling:
        params = dict(scaling)
    else:
        # A null or empty rope_scaling is no RoPE setting at all, as transformers reads it:
        # rope_parameters or, without it, the family default (GPT-OSS's YaRN, not plain RoPE).
        params = data.get("rope_parameters")
        if not isinstance(params, dict) or not params:
            return data.get("rope_theta"), None, False
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            "config.json rope_parameters is nested per layer type; one RoPE for all "
            "layers is supported"
        )
    theta = params.get("rope_theta", data.get("rope_theta"))
    return theta, {k: v for k, v in params.items() if k != "rope_theta"}, True


def _clean_scaling(scaling: dict | None) -> dict | None:
    """None for plain RoPE; drops keys that do not change it (partial factor 1)."""
    if not scaling:
        return None
    scaling = dict(scaling)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor ({scaling['partial_rotary_factor']}) is not supported"
        )
    scaling.pop("partial_rotary_factor", None)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling


def _check_required(family: str, config_cls: type, data: dict[str, Any]) -> None:
    """Raises ValueError naming every field the family config requires that ``data`` lacks
    (or sets to null); ``head_dim`` is derived and Qwen3's ``num_experts`` has an alias."""
    optional = {"head_dim"}
    if family == "qwen3_moe" and data.get("num_local_experts") is not None:
        optional.add("num_experts")
    missing = [
        f.name
        for f in dataclasses.fields(config_cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in optional
        and data.get(f.name) is None
    ]
    if missing:
        raise ValueError(
            f"config.json (model_type {family!r}) lacks {', '.join(missing)}, required to "
            f"build the model; add them as transformers' {ARCHITECTURES[family]} "
            "config.json has them"
        )


def config_from_hf(data: dict[str, Any]) -> Any:
    """Builds the family config of a Hub ``config.json`` dict.

    Args:
        data: The parsed ``config.json``.

    Returns:
        A family config dataclass instance (validated).
    """
    family = family_of_hf_config(data)
    config_cls = MODEL_FAMILIES[family][0]
    data = dict(data)
    _check_required(family, config_cls, data)
    hidden_act = data.get("hidden_act")
    if family in _HIDDEN_ACT_FAMILIES and hidden_act not in (None, *_SILU_NAMES):
        raise ValueError(
            f"config.json hidden_act ({hidden_act!r}) is not supported: {family}'s MLPs and "
            f"experts here are SwiGLU, silu(gate) * up; only {_SILU_NAMES} load as the "
            "checkpoint was trained"
        )
    dropout = data.get("attention_dropout")
    if dropout not in (None, 0):
        raise ValueError(
            f"config.json attention_dropout ({dropout!r}) is not supported: transformers drops "
            "attention probabilities with it while training, these models never do; set it to "
            "0.0 (every released checkpoint has 0.0)"
        )
    fixed = _DEEPSEEK_FIXED if family == "deepseek_v2" else {}
    for key, supported in fixed.items():
        if data.get(key) not in (None, supported):
            raise ValueError(
                f"config.json {key} ({data[key]!r}) is not supported: only {supported!r} "
                "(every released DeepSeek-V2) builds the model these weights were trained as; "
                "transformers' DeepseekV2 ignores it and would build another one"
            )
    quantization = data.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method not in _DEQUANTIZED.get(family, ()):
            raise ValueError(
                f"config.json quantization_config (quant_method {method!r}) is not supported "
                f"for {family}: its weights come with scales that load_hf does not apply; "
                "load the unquantized (bfloat16) checkpoint, or dequantize this one first"
            )
    for key, value in HF_ABSENT_DEFAULTS[family].items():
        data.setdefault(key, value)
    partial = data.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:  # the top-level spelling transformers reads too
        raise ValueError(f"partial_rotary_factor ({partial}) is not supported")
    theta, scaling, found = _split_rope(data)
    data["rope_theta"] = DEFAULT_ROPE_THETA[family] if theta is None else theta
    if found:
        data["rope_scaling"] = _clean_scaling(scaling)
    else:
        data.pop("rope_scaling", None)  # null or {}: the family's default
    if family == "qwen3_moe":
        if "num_experts" not in data and "num_local_experts" in data:
            data["num_experts"] = data["num_local_experts"]
        if data.get("head_dim") is None:
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if data.get("use_sliding_window") and data.get("sliding_window") is None:
            # transformers runs full causal attention on a null window
            data["use_sliding_window"] = False
        if not data.get("use_sliding_window"):
            data["sliding_window"] = None  # transformers' Qwen3MoeConfig keeps no unused window
    if family == "deepseek_v2":
        if "aux_loss_alpha" in data and "router_aux_loss_coef" not in data:
            data["router_aux_loss_coef"] = data["aux_loss_alpha"]
        if "seq_aux" in data and "aux_loss_type" not in data:
            data["aux_loss_type"] = "sequence" if data["seq_aux"] else "global"
        if data.get("n_shared_experts") is None:
            data["n_shared_experts"] = 0
    if family == "gpt_oss" and data.get("head_dim") is None:
        data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    values = {k: v for k, v in data.items() if k in fields}
    for key, value in list(values.items()):
        default = fields[key].default
        nullable = type(None) in typing.get_args(hints[key])
        if value is None and not nullable and default is not dataclasses.MISSING:
            # null in the file for a field that cannot be None: the family default. A
            # field that can be None keeps it (GPT-OSS's sliding_window: no window).
            del values[key]
    config = config_cls(**values)
    original = data.get("original_max_position_embeddings")
    if original is not None and rope_type_of(config.rope_scaling) == "yarn":
        # transformers gives a top-level value priority over YaRN's own (Phi-3's spelling).
        scaling = {**config.rope_scaling, "original_max_position_embeddings": original}
        config = dataclasses.replace(config, rope_scaling=scaling)
    return config


def config_to_hf(config: Any, dtype: str) -> dict[str, Any]:
    """The Hub ``config.json`` dict of a family config: RoPE in the current
    ``rope_parameters`` form and, for older readers, as ``rope_theta`` + ``rope_scaling``.
    A GPT-OSS without a window is written with every layer ``"full_attention"``, the form
    transformers runs.

    Args:
        config: A family config.
        dtype: The weights' dtype name (``"bfloat16"``), recorded as ``dtype``.

    Returns:
        A JSON-ready dict that ``transformers.AutoConfig`` reads.
    """
    family = next(name for name, (cls, _) in MODEL_FAMILIES.items() if type(config) is cls)
    data = dataclasses.asdict(config)
    for key in TRAINING_ONLY_FIELDS:
        data.pop(key, None)
    scaling = dict(data.pop("rope_scaling") or {})
    rope_type = scaling.pop("type", None) or scaling.pop("rope_type", "default")
    data["rope_parameters"] = {"rope_type": rope_type, "rope_theta": data["rope_theta"]}
    data["rope_parameters"].update(scaling)
    # The older spelling too, for readers that predate rope_parameters (transformers < 5).
    data["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    for key, value in data.items():
        if isinstance(value, tuple):
            data[key] = list(value)
    if family == "deepseek_v2":
        data["aux_loss_alpha"] = data.pop("router_aux_loss_coef")
        data["seq_aux"] = config.aux_loss_type == "sequence"
        data["num_key_value_heads"] = config.num_attention_heads
    if family == "gpt_oss" and config.sliding_window is None:
        # transformers' GPT-OSS fails on a null window: every forward builds the sliding-window
        # mask ("Could not find a `sliding_window` argument in the config, or it is not set")
        # and the cache builds one window per "sliding_attention" layer (TypeError on None).
        # Our sliding layers attend fully without a window, exactly as "full_attention" layers
        # do; the window, then used by no layer, is the whole context.
        data["layer_types"] = ["full_attention"] * config.num_hidden_layers
        data["sliding_window"] = config.max_position_embeddings
    data.update(model_type=family, architectures=[ARCHITECTURES[family]], dtype=dtype)
    return data
