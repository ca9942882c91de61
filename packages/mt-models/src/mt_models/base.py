"""What every causal-LM family shares: the decoder stack, loss, canonical names, init.

Legend: B batch, S sequence, T tokens (B·S), D model dim, V vocabulary, E experts.

A family (``qwen3_moe.py``) builds a :class:`DecoderStack` as ``self.model`` and an
``lm_head`` (or ties it to the embedding), and supplies ``flops_per_token``.
"""

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mt_models.layers.experts import EXPERT_WEIGHT_NAMES, GroupedExperts
from mt_models.layers.router import load_balancing_loss
from mt_models.protocol import RouterStats
from mt_ops import linear_cross_entropy


@dataclass(frozen=True)
class StackOutput:
    """Output of the decoder stack.

    Attributes:
        hidden_BSD: Final-normed hidden states [B, S, D].
        router_stats: Router statistics of each MoE layer, in layer order.
    """

    hidden_BSD: Tensor
    router_stats: list[RouterStats]


@dataclass(frozen=True)
class LossOutput:
    """The training loss pieces of one micro-batch; the trainer computes
    ``ce_sum / global_num_tokens + aux_loss``.

    Attributes:
        ce_sum: fp32 scalar, sum of token cross-entropy over labels != ignore_index.
        num_tokens: int64 scalar, number of such labels.
        aux_loss: fp32 scalar, ``router_aux_loss_coef`` × load-balancing loss summed over
            MoE layers (0 without MoE layers).
        router_stats: Router statistics of each MoE layer, in layer order.
    """

    ce_sum: Tensor
    num_tokens: Tensor
    aux_loss: Tensor
    router_stats: list[RouterStats]


torch.export.register_dataclass(StackOutput)
torch.export.register_dataclass(LossOutput)


class DecoderStack(nn.Module):
    """``embed_tokens`` → ``layers`` → ``norm`` (Hugging Face's ``model.*`` module).

    Args:
        embed_tokens: Token embedding [V, D].
        layers: Decoder layers following the five-phase protocol.
        norm: Final norm.
    """

    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids_BS: Tensor) -> StackOutput:
        """Runs every layer's reference forward.

        Args:
            input_ids_BS: Token ids [B, S].

        Returns:
            The :class:`StackOutput`.
        """
        h_BSD = self.embed_tokens(input_ids_BS)
        router_stats = []
        for layer in self.layers:
            out = layer(h_BSD)
            h_BSD = out.hidden_BSD
            if out.router_stats is not None:
                router_stats.append(out.router_stats)
        return StackOutput(self.norm(h_BSD), router_stats)


def _generator_for(seed: int, canonical_name: str) -> torch.Generator:
    """A CPU generator seeded by a stable hash of ``f"{seed}/{canonical_name}"``."""
    digest = hashlib.sha256(f"{seed}/{canonical_name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class CausalLM(nn.Module):
    """Base of the causal-LM families: ``self.model`` (a :class:`DecoderStack`) and
    ``self.lm_head`` (an ``nn.Linear``, or None when tied to the embedding).

    Subclasses set ``config`` (with ``router_aux_loss_coef``, ``initializer_range`` and
    ``num_hidden_layers``) and implement :meth:`flops_per_token`.
    """

    config: Any
    model: DecoderStack
    lm_head: nn.Linear | None

    @property
    def output_weight(self) -> Tensor:
        """The output projection [V, D] (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids_BS: Tensor, labels_BS: Tensor | None = None, *, ignore_index: int = -100
    ) -> Tensor | LossOutput:
        """Logits, or the loss when labels are given (see :meth:`loss`).

        Args:
            input_ids_BS: Token ids [B, S].
            labels_BS: Target ids [B, S], or None to return logits.
            ignore_index: Label value excluded from the loss.

        Returns:
            ``logits_BSV`` in the model dtype, or a :class:`LossOutput` when labels are given.
        """
        stack = self.model(input_ids_BS)
        if labels_BS is None:
            return nn.functional.linear(stack.hidden_BSD, self.output_weight)  # [B, S, V]
        if labels_BS.shape != input_ids_BS.shape:
            raise ValueError(
                f"labels shape ({tuple(labels_BS.shape)}) must equal input_ids shape "
                f"({tuple(input_ids_BS.shape)}); shift labels, don't trim them"
            )
        hidden_TD = stack.hidden_BSD.reshape(-1, stack.hidden_BSD.shape[-1])
        ce_sum, num_tokens = linear_cross_entropy(
            hidden_TD, self.output_weight, labels_BS.reshape(-1), ignore_index=ignore_index
        )
        aux_loss = torch.zeros((), dtype=torch.float32, device=hidden_TD.device)
        for stats in stack.router_stats:
            aux_loss = aux_loss + load_balancing_loss(stats)
        aux_loss = aux_loss * self.config.router_aux_loss_coef
        return LossOutput(ce_sum, num_tokens, aux_loss, stack.router_stats)

    def loss(
        self, input_ids_BS: Tensor, labels_BS: Tensor, *, ignore_index: int = -100
    ) -> LossOutput:
        """Cross-entropy sum (full logits never built) and load-balancing loss.

        Goes through ``__call__`` so module hooks (FSDP2, activation checkpointing) run.

        Args:
            input_ids_BS: Token ids [B, S].
            labels_BS: Target ids [B, S]; ``ignore_index`` entries are skipped.
            ignore_index: Label value excluded from the loss.

        Returns:
            The :class:`LossOutput`.
        """
        return self(input_ids_BS, labels_BS, ignore_index=ignore_index)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (3 × forward), ARCHITECTURE §8; family-specific."""
        raise NotImplementedError

    # ---- canonical (Hugging Face Hub) names -------------------------------------------

    def _expert_fqns(self) -> dict[str, tuple[str, str, GroupedExperts]]:
        """Stacked expert parameter FQN → (module prefix, weight name, module)."""
        out = {}
        for prefix, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                for name in EXPERT_WEIGHT_NAMES:
                    out[f"{prefix}.{name}.weight"] = (prefix, name, module)
        return out

    def to_canonical(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Renames parameter-shaped tensors to Hugging Face Hub keys, one key per expert.

        Non-expert FQNs already are Hub keys. A stacked expert tensor
        ``<prefix>.gate_proj.weight`` [E, F, D] becomes ``<prefix>.{e}.gate_proj.weight`` → ``t[e]``
        for global expert ids e, as views sharing storage (writes land in the stack).

        Args:
            tensors: Keyed by this model's parameter FQNs: the parameters themselves or
                tensors of their shapes (e.g. optimizer ``exp_avg``).

        Returns:
            Hub key → tensor.
        """
        expert_fqns = self._expert_fqns()
        param_names = {name for name, _ in self.named_parameters()}
        out: dict[str, Tensor] = {}
        for fqn, tensor in tensors.items():
            if fqn in expert_fqns:
                prefix, name, module = expert_fqns[fqn]
                if tensor.shape[0] != module.num_experts:
                    raise ValueError(
                        f"{fqn} has {tensor.shape[0]} experts in dim 0 but the module holds "
                        f"{module.num_experts}; pass tensors shaped like the parameters"
                    )
                for local in range(module.num_experts):
                    expert_id = module.first_expert_id + local
                    out[f"{prefix}.{expert_id}.{name}.weight"] = tensor[local]
            elif fqn in param_names:
                out[fqn] = tensor
            else:
                raise ValueError(
                    f"{fqn!r} is not a parameter name of {type(self).__name__}; pass a dict "
                    "keyed by model.named_parameters() names"
                )
        return out

    def canonical_parameters(self) -> dict[str, Tensor]:
        """``to_canonical(dict(named_parameters()))``: Hub key → parameter (or expert view)."""
        return self.to_canonical(dict(self.named_parameters()))

    # ---- initialization ----------------------------------------------------------------

    def init_rule(self, canonical_name: str) -> tuple[str, float]:
        """The rule of one parameter: ``("ones" | "zeros" | "normal", std)``.

        See :meth:`init_weights` for the list.
        """
        std = self.config.initializer_range
        if canonical_name.endswith("norm.weight"):
            return "ones", 0.0
        if canonical_name.endswith(".bias"):
            return "zeros", 0.0
        if canonical_name.endswith(("o_proj.weight", "down_proj.weight")):
            return "normal", std / math.sqrt(2 * self.config.num_hidden_layers)
        return "normal", std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initializes every parameter as a function of (seed, canonical name) only.

        Rules (std = ``config.initializer_range``, 0.02 for Qwen3):

        - norms (``*norm.weight``: input/post-attention layernorms, q_norm, k_norm,
          ``model.norm``): ones;
        - biases: zeros;
        - residual output projections (``self_attn.o_proj``, ``mlp.down_proj`` and every
          expert's ``down_proj``): normal(0, std / sqrt(2 · num_hidden_layers))
          (GPT-2's scaling, so the residual stream's variance does not grow with depth);
        - everything else (``embed_tokens``, q/k/v projections, router ``mlp.gate``,
          ``gate_proj``/``up_proj`` dense and per expert, ``lm_head``): normal(0, std).

        Values are drawn in fp32 on the CPU from a generator seeded with the first 8 bytes
        of sha256(f"{seed}/{canonical_name}"), then copied into the parameter (any device
        and dtype). Stacked experts are drawn expert by expert under their per-expert Hub
        names, so expert e's weights do not depend on how many experts a module holds.
        Works after ``to_empty`` from a meta-device build.

        Args:
            seed: The run's seed.
        """
        for name, tensor in self.canonical_parameters().items():
            rule, std = self.init_rule(name)
            if rule == "ones":
                tensor.fill_(1.0)
            elif rule == "zeros":
                tensor.zero_()
            else:
                values = torch.randn(
                    tensor.shape, generator=_generator_for(seed, name), dtype=torch.float32
                )
                tensor.copy_(values * std)
