"""Qwen3-MoE: config (Hugging Face field names), presets, and the causal LM.

Assembled from shared layers: GQA attention with per-head QK-norm and RoPE (optionally
YaRN, optionally a sliding window on every layer when ``use_sliding_window``), softmax
top-k router with optional renormalization, grouped SwiGLU experts, no shared expert. Layer i is
sparse when ``i not in mlp_only_layers and num_experts > 0 and (i + 1) %
decoder_sparse_step == 0`` (as in ``transformers``' ``Qwen3MoeDecoderLayer``); otherwise
it has a dense SwiGLU MLP of ``intermediate_size``.
"""

from dataclasses import dataclass

from mt_models.base import CausalLM
from mt_models.configs import check_finite, check_positive, check_rope, check_router_losses
from mt_models.layers import (
    DecoderLayer,
    GQAAttention,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUExperts,
    SwiGLUMLP,
    TopKRouter,
)


@dataclass
class Qwen3MoeConfig:
    """Qwen3-MoE hyper-parameters, named as in the Hub's ``config.json``.

    Attributes:
        vocab_size: V.
        hidden_size: D.
        intermediate_size: Hidden dim of dense MLP layers.
        moe_intermediate_size: F, hidden dim of each expert.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (divides the query heads).
        head_dim: Size of each head (even, for RoPE).
        num_experts: E (0: every layer dense).
        num_experts_per_tok: K.
        norm_topk_prob: Renormalize the top-k weights to sum to one.
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: The Hub's RoPE scaling dict (YaRN), or None.
        max_position_embeddings: Longest sequence the model is meant for.
        tie_word_embeddings: Use the embedding as the output projection.
        decoder_sparse_step: Every this-many-th layer is sparse.
        mlp_only_layers: Layer indices forced dense.
        router_aux_loss_coef: Weight of the load-balancing loss.
        attention_bias: Biases on q/k/v/o projections.
        initializer_range: Std of the normal initialization.
        use_sliding_window: Every layer attends within ``sliding_window`` keys.
        sliding_window: The window (used only with ``use_sliding_window``).
        aux_loss_type: ``"global"`` or ``"sequence"`` load balancing (training only).
        load_balancing: ``"pooled"`` or ``"per_layer"``: how layers' balancing losses
            combine (training only; the default pools them as transformers does, so the
            Hub's coefficient keeps its meaning; ``mt_models.configs.LOAD_BALANCING``).
        router_z_loss_coef: Weight of the router z-loss (training only; 0 is off).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    attention_bias: bool = False
    initializer_range: float = 0.02
    use_sliding_window: bool = False
    sliding_window: int | None = None
    aux_loss_type: str = "global"
    load_balancing: str = "pooled"
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "decoder_sparse_step",
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
        if self.num_experts < 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be >= 0")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]; lower the top-k or add experts"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"mlp_only_layers entries {bad} must be layer indices in "
                f"[0, num_hidden_layers={self.num_hidden_layers})"
            )
        if self.use_sliding_window and (self.sliding_window or 0) < 1:
            raise ValueError(
                f"sliding_window ({self.sliding_window}) must be >= 1 when use_sliding_window"
            )
        check_rope(self)
        check_router_losses(self)

    @property
    def window(self) -> int | None:
        """The attention window of every layer (None: full causal)."""
        return self.sliding_window if self.use_sliding_window else None

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (else a dense MLP)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def debug() -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE for CPU tests: 4 layers, 8 experts top-2, D = 128."""
    return Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        router_aux_loss_coef=0.01,
    )


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-30B-A3B (Hub ``config.json``)."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
    )


def qwen3_235b_a22b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-235B-A22B (Hub ``config.json``)."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
    )


def _build_layer(config: Qwen3MoeConfig, layer_idx: int) -> DecoderLayer:
    dim, eps = config.hidden_size, config.rms_norm_eps
    if config.is_sparse_layer(layer_idx):
        router = TopKRouter(
            dim,
            config.num_experts,
            config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
        )
        experts = SwiGLUExperts(config.num_experts, dim, config.moe_intermediate_size)
        mlp = MoEBlock(router, experts, router_name="gate")
    else:
        mlp = SwiGLUMLP(dim, config.intermediate_size)
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
            eps=eps,
            bias=config.attention_bias,
            qk_norm=True,
            window=config.window,
        ),
        mlp=mlp,
        input_layernorm=RMSNorm(dim, eps),
        post_attention_layernorm=RMSNorm(dim, eps),
    )


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE causal LM; parameter FQNs are the Hub keys except stacked experts.

    Build on meta, materialize, then initialize::

        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(config)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)

    Args:
        config: The :class:`Qwen3MoeConfig`.
    """

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__(config, _build_layer)
