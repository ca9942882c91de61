"""GPT-OSS: config (Hugging Face field names), presets, and the causal LM.

Assembled from shared layers: GQA attention with biases and one learned sink per head,
alternating sliding-window / full layers (``layer_types``), YaRN RoPE (``truncate`` false),
a router with a bias that takes the top-k logits and softmaxes them, and experts with
biases and the clamped SwiGLU over an interleaved gate/up projection
(``ClampedSwiGLUExperts``). Every layer is sparse.

The Hub stores experts stacked (``mlp.experts.gate_up_proj`` [E, D, 2F] and friends, or
MXFP4 ``_blocks``/``_scales``); canonical names split them per expert (``hf_io``).
"""

from dataclasses import dataclass, field

from mt_models.base import CausalLM
from mt_models.configs import check_finite, check_positive, check_rope, check_router_losses
from mt_models.layers import (
    ClampedSwiGLUExperts,
    DecoderLayer,
    GQAAttention,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    TopKRouter,
)

LAYER_TYPES = ("sliding_attention", "full_attention")


def _default_yarn() -> dict:
    return {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }


@dataclass
class GptOssConfig:
    """GPT-OSS hyper-parameters, named as in the Hub's ``config.json``.

    Attributes:
        vocab_size: V.
        hidden_size: D.
        intermediate_size: F, hidden dim of each expert.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: H.
        num_key_value_heads: G (divides H).
        head_dim: Dh.
        num_local_experts: E.
        num_experts_per_tok: K.
        sliding_window: Window of the ``sliding_attention`` layers (None: they attend fully;
            exported with every layer ``"full_attention"``, as transformers needs).
        layer_types: ``"sliding_attention"`` or ``"full_attention"`` per layer (default:
            alternating, sliding first).
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: The Hub's RoPE scaling dict (YaRN by default), or None.
        max_position_embeddings: Longest sequence the model is meant for.
        swiglu_alpha: Slope in the clamped SwiGLU's sigmoid.
        swiglu_limit: Clamp bound of the clamped SwiGLU.
        attention_bias: Biases on q/k/v/o projections.
        tie_word_embeddings: Use the embedding as the output projection.
        initializer_range: Std of the normal initialization.
        router_aux_loss_coef: Weight of the load-balancing loss.
        aux_loss_type: ``"global"`` or ``"sequence"`` load balancing (training only).
        load_balancing: ``"pooled"`` or ``"per_layer"``: how layers' balancing losses
            combine (training only; the default pools them as transformers does, so the
            Hub's coefficient keeps its meaning; ``mt_models.configs.LOAD_BALANCING``).
        router_z_loss_coef: Weight of the router z-loss (training only; 0 is off).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = field(default_factory=_default_yarn)
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    aux_loss_type: str = "global"
    load_balancing: str = "pooled"
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_local_experts",
            "max_position_embeddings",
        ]
        check_finite(self)
        check_positive(self, positive)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads}); choose a divisor"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_local_experts={self.num_local_experts}]"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= 1 or None")
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if len(self.layer_types) != self.num_hidden_layers or bad:
            raise ValueError(
                f"layer_types ({self.layer_types}) must list one of {LAYER_TYPES} for each of "
                f"the {self.num_hidden_layers} layers; after changing num_hidden_layers, set "
                "layer_types again, or to None for the default (alternating, sliding first)"
            )
        if self.swiglu_alpha <= 0 or self.swiglu_limit <= 0:
            raise ValueError(
                f"swiglu_alpha ({self.swiglu_alpha}) and swiglu_limit ({self.swiglu_limit}) "
                "must be > 0"
            )
        check_rope(self)
        check_router_losses(self)

    @property
    def num_experts(self) -> int:
        """E (``num_local_experts``), under the name the other families use."""
        return self.num_local_experts

    def window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full causal)."""
        sliding = self.layer_types[layer_idx] == "sliding_attention"
        return self.sliding_window if sliding else None


def debug() -> GptOssConfig:
    """A tiny GPT-OSS for CPU tests: 4 layers alternating window 64 / full, 8 experts top-2."""
    return GptOssConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        max_position_embeddings=4096,
        router_aux_loss_coef=0.01,
    )


def _gpt_oss(num_hidden_layers: int, num_local_experts: int) -> GptOssConfig:
    return GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=num_local_experts,
        num_experts_per_tok=4,
        sliding_window=128,
        rope_theta=150000.0,
        max_position_embeddings=131072,
        router_aux_loss_coef=0.9,
    )


def gpt_oss_20b() -> GptOssConfig:
    """openai/gpt-oss-20b (Hub ``config.json``): 21B total, 3.6B active."""
    return _gpt_oss(num_hidden_layers=24, num_local_experts=32)


def gpt_oss_120b() -> GptOssConfig:
    """openai/gpt-oss-120b (Hub ``config.json``): 117B total, 5.1B active."""
    return _gpt_oss(num_hidden_layers=36, num_local_experts=128)


def _build_layer(config: GptOssConfig, layer_idx: int) -> DecoderLayer:
    dim = config.hidden_size
    router = TopKRouter(
        dim,
        config.num_local_experts,
        config.num_experts_per_tok,
        scoring_func="softmax_topk",
        bias=True,
    )
    experts = ClampedSwiGLUExperts(
        config.num_local_experts,
        dim,
        config.intermediate_size,
        config.swiglu_alpha,
        config.swiglu_limit,
    )
    rotary = RotaryEmbedding(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    return DecoderLayer(
        self_attn=GQAAttention(
            dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            rotary,
            bias=config.attention_bias,
            sinks=True,
            window=config.window(layer_idx),
        ),
        mlp=MoEBlock(router, experts, router_name="router"),
        input_layernorm=RMSNorm(dim, config.rms_norm_eps),
        post_attention_layernorm=RMSNorm(dim, config.rms_norm_eps),
    )


class GptOssForCausalLM(CausalLM):
    """GPT-OSS causal LM; parameter FQNs are the Hub keys except experts (split per expert
    in canonical form, stacked and transposed in Hub files).

    Args:
        config: The :class:`GptOssConfig`.
    """

    def __init__(self, config: GptOssConfig):
        super().__init__(config, _build_layer)
