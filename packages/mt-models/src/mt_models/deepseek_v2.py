"""DeepSeek-V2: config (Hugging Face field names), presets, and the causal LM.

Assembled from shared layers: multi-head latent attention (``layers/mla.py``: optional
q LoRA, rope/nope split, Dv ≠ Dqk, interleaved RoPE with YaRN and its softmax-scale
correction), softmax top-k router (greedy or group-limited greedy) with
``routed_scaling_factor``, grouped SwiGLU experts plus ``n_shared_experts`` shared experts
fused into one dense MLP, and dense layers for the first ``first_k_dense_replace`` layers
(as ``transformers``' ``DeepseekV2DecoderLayer``).

Like ``transformers``, the routed weights are not renormalized (``norm_topk_prob`` is kept
for the Hub file; both released models set it false, and true is refused: the original
code renormalizes, transformers does not).
"""

from dataclasses import dataclass

from mt_models.base import CausalLM
from mt_models.configs import check_finite, check_positive, check_rope, check_router_losses
from mt_models.layers import (
    DecoderLayer,
    MLAAttention,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUExperts,
    SwiGLUMLP,
    TopKRouter,
)

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass
class DeepseekV2Config:
    """DeepSeek-V2 hyper-parameters, named as in the Hub's ``config.json``.

    Attributes:
        vocab_size: V.
        hidden_size: D.
        intermediate_size: Hidden dim of the dense layers.
        moe_intermediate_size: F, hidden dim of each routed (and shared) expert.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: H.
        n_routed_experts: E.
        num_experts_per_tok: K.
        n_shared_experts: Shared experts (one dense MLP of ``n · F``); 0 for none.
        kv_lora_rank: Rank of the compressed key/value latent.
        q_lora_rank: Rank of the query LoRA, or None for a full ``q_proj``.
        qk_nope_head_dim: Non-rotary query/key dims per head.
        qk_rope_head_dim: Rotary query/key dims per head.
        v_head_dim: Value dims per head.
        first_k_dense_replace: Layers ``0..k-1`` are dense.
        topk_method: ``"greedy"`` or ``"group_limited_greedy"``.
        n_group: Expert groups (group-limited routing).
        topk_group: Groups kept per token (group-limited routing).
        routed_scaling_factor: Multiplier of the routed weights.
        norm_topk_prob: Kept for the Hub file; false only (with K > 1, true renormalizes the
            top-k weights in the original code, and transformers ignores it).
        rms_norm_eps: Epsilon of the layer RMSNorms.
        rope_theta: RoPE base.
        rope_scaling: The Hub's RoPE scaling dict (YaRN), or None.
        max_position_embeddings: Longest sequence the model is meant for.
        tie_word_embeddings: Use the embedding as the output projection.
        attention_bias: Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        mlp_bias: Biases on the dense and shared MLPs.
        initializer_range: Std of the normal initialization.
        router_aux_loss_coef: Weight of the load-balancing loss (the Hub's
            ``aux_loss_alpha``).
        aux_loss_type: ``"global"`` or ``"sequence"`` (the Hub's ``seq_aux``).
        load_balancing: ``"pooled"`` or ``"per_layer"``: how layers' balancing losses
            combine (training only; the default sums them as DeepSeek-V2 does, so the
            Hub's ``aux_loss_alpha`` keeps its meaning; ``mt_models.configs.LOAD_BALANCING``).
        router_z_loss_coef: Weight of the router z-loss (training only; 0 is off).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 0
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    first_k_dense_replace: int = 0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    aux_loss_type: str = "global"
    load_balancing: str = "per_layer"
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "n_routed_experts",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        ]
        check_finite(self)
        check_positive(self, positive)
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, n_routed_experts={self.n_routed_experts}]"
            )
        if self.qk_rope_head_dim % 2 or self.qk_nope_head_dim < 0 or self.n_shared_experts < 0:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even, qk_nope_head_dim "
                f"({self.qk_nope_head_dim}) and n_shared_experts ({self.n_shared_experts}) >= 0"
            )
        if self.norm_topk_prob and self.num_experts_per_tok > 1:
            raise ValueError(
                f"norm_topk_prob ({self.norm_topk_prob}) is not supported: the original "
                "DeepSeek-V2 code renormalizes the top-k weights to sum to one, transformers' "
                "port (and this one) ignores the field, so the router would not be the one "
                "the weights were trained with; set it to false (every released DeepSeek-V2)"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank ({self.q_lora_rank}) must be >= 1 or None")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method ({self.topk_method!r}) must be one of {TOPK_METHODS}; "
                "DeepSeek-V3's 'noaux_tc' is not a DeepSeek-V2 method"
            )
        if self.topk_method == "group_limited_greedy" and (
            not self.n_group
            or self.n_routed_experts % self.n_group
            or not 1 <= (self.topk_group or 0) <= self.n_group
        ):
            raise ValueError(
                f"group_limited_greedy needs n_group ({self.n_group}) dividing n_routed_experts "
                f"({self.n_routed_experts}) and topk_group ({self.topk_group}) in [1, n_group]"
            )
        if self.topk_method == "group_limited_greedy":
            kept = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.num_experts_per_tok > kept:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {kept} "
                    f"experts group_limited_greedy keeps (topk_group {self.topk_group} of "
                    f"n_group {self.n_group} groups of {self.n_routed_experts // self.n_group}"
                    "); raise topk_group or lower num_experts_per_tok"
                )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        check_rope(self)
        scaling = self.rope_scaling or {}
        scaled = scaling.get("rope_type", "default") != "default"
        if scaled and scaling.get("mscale_all_dim") and scaling.get("factor") is None:
            raise ValueError(
                f"rope_scaling ({scaling}) sets mscale_all_dim but no factor: MLA's softmax "
                "scale is corrected by mscale(factor, mscale_all_dim)^2; add the factor "
                "(the context extension, e.g. 40)"
            )
        check_router_losses(self)

    @property
    def num_experts(self) -> int:
        """E (``n_routed_experts``), under the name the other families use."""
        return self.n_routed_experts

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (else a dense MLP)."""
        return layer_idx >= self.first_k_dense_replace


def debug() -> DeepseekV2Config:
    """A tiny DeepSeek-V2 for CPU tests: 3 layers (first dense), 8 experts top-2 in 4 groups,
    a shared expert, q LoRA, D = 128."""
    return DeepseekV2Config(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
        max_position_embeddings=2048,
        router_aux_loss_coef=0.01,
        aux_loss_type="sequence",
    )


def _yarn(factor: float, original: int) -> dict:
    return {
        "type": "yarn",
        "factor": factor,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": original,
    }


def deepseek_v2_lite() -> DeepseekV2Config:
    """deepseek-ai/DeepSeek-V2-Lite (Hub ``config.json``): 15.7B total, 2.4B active."""
    return DeepseekV2Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=_yarn(40, 4096),
        router_aux_loss_coef=0.001,
        aux_loss_type="sequence",
    )


def deepseek_v2() -> DeepseekV2Config:
    """deepseek-ai/DeepSeek-V2 (Hub ``config.json``): 236B total, 21B active."""
    return DeepseekV2Config(
        vocab_size=102400,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=60,
        num_attention_heads=128,
        n_routed_experts=160,
        num_experts_per_tok=6,
        n_shared_experts=2,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=_yarn(40, 4096),
        router_aux_loss_coef=0.003,
        aux_loss_type="sequence",
    )


def _build_layer(config: DeepseekV2Config, layer_idx: int) -> DecoderLayer:
    dim = config.hidden_size
    if config.is_sparse_layer(layer_idx):
        grouped = config.topk_method == "group_limited_greedy"
        router = TopKRouter(
            dim,
            config.n_routed_experts,
            config.num_experts_per_tok,
            n_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            routed_scaling_factor=config.routed_scaling_factor,
        )
        experts = SwiGLUExperts(config.n_routed_experts, dim, config.moe_intermediate_size)
        shared_dim = config.moe_intermediate_size * config.n_shared_experts
        shared = SwiGLUMLP(dim, shared_dim, bias=config.mlp_bias) if shared_dim else None
        mlp = MoEBlock(router, experts, shared, router_name="gate")
    else:
        mlp = SwiGLUMLP(dim, config.intermediate_size, bias=config.mlp_bias)
    rotary = RotaryEmbedding(
        config.qk_rope_head_dim,
        config.rope_theta,
        config.rope_scaling,
        config.max_position_embeddings,
    )
    attn = MLAAttention(
        dim,
        config.num_attention_heads,
        config.q_lora_rank,
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        rotary,
        config.rope_scaling,
        bias=config.attention_bias,
    )
    return DecoderLayer(
        self_attn=attn,
        mlp=mlp,
        input_layernorm=RMSNorm(dim, config.rms_norm_eps),
        post_attention_layernorm=RMSNorm(dim, config.rms_norm_eps),
    )


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 causal LM; parameter FQNs are the Hub keys except stacked experts.

    Args:
        config: The :class:`DeepseekV2Config`.
    """

    def __init__(self, config: DeepseekV2Config):
        super().__init__(config, _build_layer)
