"""What every causal-LM family shares: the decoder stack, loss, canonical names, init.

Legend: B batch, S sequence, T tokens (B·S), D model dim, V vocabulary, E experts.

A family (``qwen3_moe.py``, ``deepseek_v2.py``, ``gpt_oss.py``) is a config plus an
assembly: it builds a :class:`DecoderStack` of shared layers as ``self.model`` and an
``lm_head`` (or ties it to the embedding). Loss, auxiliary losses, canonical names,
initialization and FLOP accounting (``accounting.py``) are shared.
"""

import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mt_models.accounting import FlopsAndParams
from mt_models.layers.experts import GroupedExperts
from mt_models.layers.linear import Embedding, Linear
from mt_models.layers.norm import RMSNorm
from mt_models.layers.router import (
    load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
)
from mt_models.protocol import RouterStats
from mt_ops import GroupedLinear, linear_cross_entropy


@dataclass(frozen=True)
class StackOutput:
    """Output of the decoder stack.

    Attributes:
        hidden_BSD: Final-normed hidden states [B, S, D].
        router_stats: Router statistics of each MoE layer, in layer order.
    """

    hidden_BSD: Tensor
    router_stats: list[RouterStats]


def _add_stats(router_stats: list[RouterStats]) -> RouterStats:
    """Field-wise sum of router statistics (all layers' tokens pooled into one set)."""
    fields = dataclasses.fields(RouterStats)
    return RouterStats(
        **{f.name: torch.stack([getattr(s, f.name) for s in router_stats]).sum(0) for f in fields}
    )


@dataclass(frozen=True)
class LossOutput:
    """The training loss pieces of one micro-batch; the trainer computes
    ``ce_sum / global_num_tokens + aux_loss``.

    Attributes:
        ce_sum: fp32 scalar, sum of token cross-entropy over labels != ignore_index.
        num_tokens: int64 scalar, number of such labels.
        aux_loss: fp32 scalar, ``router_aux_loss_coef`` × load-balancing loss plus
            ``router_z_loss_coef`` × router z-loss, each summed over MoE layers (0 without
            MoE layers).
        router_stats: Router statistics of each MoE layer, in layer order, as produced
            (before ``router_stats_reducer``).
        losses: Named unweighted scalars for logging (detached, summed over MoE layers):
            ``load_balancing_loss`` (the variant of ``config.aux_loss_type``) and
            ``router_z_loss``.
    """

    ce_sum: Tensor
    num_tokens: Tensor
    aux_loss: Tensor
    router_stats: list[RouterStats]
    losses: dict[str, Tensor] = field(default_factory=dict)


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

    def forward(self, input_ids_BS: Tensor, position_ids: Tensor | None = None) -> StackOutput:
        """Runs every layer's reference forward.

        Args:
            input_ids_BS: Token ids [B, S].
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            The :class:`StackOutput`.
        """
        h_BSD = self.embed_tokens(input_ids_BS)
        router_stats = []
        for layer in self.layers:
            out = layer(h_BSD, position_ids)
            h_BSD = out.hidden_BSD
            if out.router_stats is not None:
                router_stats.append(out.router_stats)
        return StackOutput(self.norm(h_BSD), router_stats)


_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_inputs(
    input_ids_BS: Tensor, labels_BS: Tensor | None, position_ids: Tensor | None, vocab_size: int
) -> None:
    """Raises ValueError naming the input whose shape, dtype or (on the CPU) token id
    :meth:`CausalLM.forward` cannot take (before: an unpacking error deep in a layer, a
    gather dtype error, or the embedding's "index out of range in self")."""
    if input_ids_BS.dim() != 2 or input_ids_BS.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"input_ids ({input_ids_BS.dtype} {tuple(input_ids_BS.shape)}) must be int64 or "
            "int32 [B, S]; add a batch dim with input_ids[None] and pass token ids, not floats"
        )
    if input_ids_BS.device.type == "cpu":  # free on the host; on GPU it would sync
        bad_BS = (input_ids_BS < 0) | (input_ids_BS >= vocab_size)
        if bool(bad_BS.any()):
            b, s = (int(i) for i in bad_BS.nonzero()[0])
            raise ValueError(
                f"input_ids[{b}, {s}] is {int(input_ids_BS[b, s])}, outside [0, "
                f"vocab_size={vocab_size}); the tokenizer does not match the model (compare "
                "its vocabulary with config vocab_size), or pad with a token id of the vocabulary"
            )
    if labels_BS is not None:
        if labels_BS.shape != input_ids_BS.shape:
            raise ValueError(
                f"labels shape ({tuple(labels_BS.shape)}) must equal input_ids shape "
                f"({tuple(input_ids_BS.shape)}); shift labels, don't trim them"
            )
        if labels_BS.dtype not in _INDEX_DTYPES:
            raise ValueError(f"labels dtype ({labels_BS.dtype}) must be int64 or int32")
    if position_ids is None:
        return
    batch, seq_len = input_ids_BS.shape
    shape = tuple(position_ids.shape)
    fits = shape == (seq_len,) or (
        len(shape) == 2 and shape[0] in (1, batch) and shape[1] == seq_len
    )
    if not fits or position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(
            f"position_ids ({position_ids.dtype} {shape}) must be integers shaped [S] = "
            f"[{seq_len}] or [B, S] = [{batch}, {seq_len}]; one position per input token"
        )


def _generator_for(seed: int, canonical_name: str) -> torch.Generator:
    """A CPU generator seeded by a stable hash of ``f"{seed}/{canonical_name}"``."""
    digest = hashlib.sha256(f"{seed}/{canonical_name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class CausalLM(nn.Module):
    """Base of the causal-LM families: ``self.model`` (a :class:`DecoderStack`) and
    ``self.lm_head`` (an ``nn.Linear``, or None when tied to the embedding).

    Subclasses set ``config`` (with ``router_aux_loss_coef``, ``initializer_range`` and
    ``num_hidden_layers``; optionally ``aux_loss_type`` and ``router_z_loss_coef``).

    Attributes:
        router_stats_reducer: Applied to each MoE layer's :class:`RouterStats` before the
            auxiliary losses are computed (None: the local statistics). mt-parallel sets it
            to an all-reduce over the ranks sharing the global batch; it must keep the
            autograd graph of ``prob_sum_*`` (the router's gradient flows through it).
    """

    config: Any
    model: DecoderStack
    lm_head: nn.Linear | None
    router_stats_reducer: Callable[[RouterStats], RouterStats] | None = None

    def __init__(self, config: Any, build_layer: Callable[[Any, int], nn.Module]):
        """Assembles embedding, ``num_hidden_layers`` decoder layers, final norm and head.

        Args:
            config: The family config (``vocab_size``, ``hidden_size``, ``rms_norm_eps``,
                ``num_hidden_layers``, ``tie_word_embeddings``, ...).
            build_layer: The family's assembly of decoder layer ``i`` from shared layers.
        """
        super().__init__()
        self.config = config
        self.model = DecoderStack(
            embed_tokens=Embedding(config.vocab_size, config.hidden_size),
            layers=[build_layer(config, i) for i in range(config.num_hidden_layers)],
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def output_weight(self) -> Tensor:
        """The output projection [V, D] (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids_BS: Tensor,
        labels_BS: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        ignore_index: int = -100,
    ) -> Tensor | LossOutput:
        """Logits, or the loss when labels are given (see :meth:`loss`).

        Args:
            input_ids_BS: Token ids [B, S].
            labels_BS: Target ids [B, S], or None to return logits.
            position_ids: Token positions (int64 [S] or [B, S]) that set RoPE; None for
                ``arange(S)``. Context parallelism passes the global positions of its
                slice. Packed documents restart them per document; the local attention
                core then keeps attention inside each document.
            ignore_index: Label value excluded from the loss.

        Returns:
            ``logits_BSV`` in the model dtype, or a :class:`LossOutput` when labels are given.
        """
        _check_inputs(input_ids_BS, labels_BS, position_ids, self.config.vocab_size)
        stack = self.model(input_ids_BS, position_ids)
        if labels_BS is None:
            return nn.functional.linear(stack.hidden_BSD, self.output_weight)  # [B, S, V]
        hidden_TD = stack.hidden_BSD.reshape(-1, stack.hidden_BSD.shape[-1])
        ce_sum, num_tokens = linear_cross_entropy(
            hidden_TD, self.output_weight, labels_BS.reshape(-1), ignore_index=ignore_index
        )
        aux_loss, losses = self.auxiliary_losses(stack.router_stats, hidden_TD.device)
        return LossOutput(ce_sum, num_tokens, aux_loss, stack.router_stats, losses)

    def auxiliary_losses(
        self, router_stats: list[RouterStats], device: torch.device
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted load-balancing and z losses from (reduced) router statistics.

        ``config.aux_loss_type`` picks the balancing variant: ``"global"`` (over the whole
        batch, HF's) or ``"sequence"`` (per sequence, averaged). ``config.load_balancing``
        combines the layers: ``"pooled"`` takes one loss of all layers' statistics added
        together (transformers' ``load_balancing_loss_func`` over every layer's router
        logits; K for uniform routing), ``"per_layer"`` sums each layer's loss divided by
        K (DeepSeek-V2, Megatron-Core; 1 per layer for uniform routing). The z-loss is
        summed over layers. ``router_aux_loss_coef`` and ``router_z_loss_coef`` (0
        switches a loss off) weight them.

        Args:
            router_stats: Each MoE layer's statistics.
            device: Where the zero of a model without MoE layers lives.

        Returns:
            ``(aux_loss, losses)`` as in :class:`LossOutput`.
        """
        per_sequence = getattr(self.config, "aux_loss_type", "global") == "sequence"
        balance_fn = sequence_load_balancing_loss if per_sequence else load_balancing_loss
        pooled = getattr(self.config, "load_balancing", "pooled") == "pooled"
        balance = torch.zeros((), dtype=torch.float32, device=device)
        z_loss = torch.zeros((), dtype=torch.float32, device=device)
        if self.router_stats_reducer is not None:
            router_stats = [self.router_stats_reducer(stats) for stats in router_stats]
        for stats in router_stats:
            z_loss = z_loss + router_z_loss(stats)
            if not pooled:
                balance = balance + balance_fn(stats) / self.config.num_experts_per_tok
        if pooled and router_stats:
            balance = balance_fn(_add_stats(router_stats))
        z_coef = getattr(self.config, "router_z_loss_coef", 0.0)
        aux_loss = balance * self.config.router_aux_loss_coef + z_loss * z_coef
        losses = {"load_balancing_loss": balance.detach(), "router_z_loss": z_loss.detach()}
        return aux_loss, losses

    def loss(
        self,
        input_ids_BS: Tensor,
        labels_BS: Tensor,
        *,
        position_ids: Tensor | None = None,
        ignore_index: int = -100,
    ) -> LossOutput:
        """Cross-entropy sum (full logits never built) and auxiliary router losses.

        Goes through ``__call__`` so module hooks (FSDP2, activation checkpointing) run.

        Args:
            input_ids_BS: Token ids [B, S].
            labels_BS: Target ids [B, S]; ``ignore_index`` entries are skipped.
            position_ids: Token positions [S] or [B, S]; None for ``arange(S)``.
            ignore_index: Label value excluded from the loss.

        Returns:
            The :class:`LossOutput`.
        """
        return self(input_ids_BS, labels_BS, position_ids=position_ids, ignore_index=ignore_index)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 × forward (ARCHITECTURE §8).

        Forward counts 2 FLOPs per multiply-add of every matmul with its active weights
        (attention projections, router, top-k routed and shared experts or the dense MLP,
        output head) plus attention scores ``2 · H · (Dqk + Dv) · context`` per layer
        (context S/2 causal, ``W − W²/2S`` for a window W). Embedding lookups, norms,
        biases and elementwise ops are not counted.

        Args:
            seq_len: S, the training sequence length.

        Returns:
            FLOPs per token of one forward + backward.
        """
        return FlopsAndParams.of(self, seq_len).train_flops_per_token

    def parameter_counts(self) -> tuple[int, int]:
        """``(total, active per token)`` parameter counts (active: K of E experts).

        Returns:
            The two counts, embeddings and head included.
        """
        counts = FlopsAndParams.of(self, 1)
        return counts.total_params, counts.active_params

    # ---- canonical (Hugging Face Hub) names -------------------------------------------

    def _expert_fqns(self) -> dict[str, tuple[str, str, nn.Module]]:
        """Stacked expert parameter FQN → (experts prefix, ``<proj>.<param>``, experts module).

        Each ``GroupedLinear`` child of a :class:`GroupedExperts` module is split per expert.
        """
        out = {}
        for prefix, module in self.named_modules():
            if not isinstance(module, GroupedExperts):
                continue
            for child_name, child in module.named_children():
                if isinstance(child, GroupedLinear):
                    for param_name, _ in child.named_parameters():
                        suffix = f"{child_name}.{param_name}"
                        out[f"{prefix}.{suffix}"] = (prefix, suffix, module)
        return out

    def to_canonical(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Renames parameter-shaped tensors to Hugging Face Hub keys, one key per expert.

        Non-expert FQNs already are Hub keys. A stacked expert tensor
        ``<prefix>.gate_proj.weight`` [E, F, D] becomes ``<prefix>.{e}.gate_proj.weight`` → ``t[e]``
        for global expert ids e, as views sharing storage (writes land in the stack).
        FSDP2-sharded tensors (DTensors) are not gathered: a non-expert one keeps its key as
        it is, and a sharded expert stack (sharded along the expert dim, so each rank holds
        whole experts) gives only the experts of this rank's shard, as views of it.

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
                first, local = _experts_held(fqn, tensor)
                for i in range(local.shape[0]):
                    expert_id = module.first_expert_id + first + i
                    out[f"{prefix}.{expert_id}.{name}"] = local[i]
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
        if canonical_name.endswith(("bias", ".sinks")):
            return "zeros", 0.0
        if canonical_name.endswith(("o_proj.weight", "down_proj.weight")):
            return "normal", std / math.sqrt(2 * self.config.num_hidden_layers)
        return "normal", std

    @torch.no_grad()
    def init_weights(self, seed: int, *, skip_meta: bool = False) -> None:
        """Initializes every parameter as a function of (seed, canonical name) only; the
        canonical name of an expert's tensor holds its global expert id.

        Rules (std = ``config.initializer_range``, 0.02 for all three families):

        - norms (``*norm.weight``: input/post-attention layernorms, q_norm, k_norm,
          MLA's q_a/kv_a layernorms, ``model.norm``): ones;
        - biases (projections, experts, router, ``e_score_correction_bias``) and attention
          sinks: zeros (a zero sink starts as one extra softmax slot of logit 0);
        - residual output projections (``self_attn.o_proj``, ``mlp.down_proj`` and every
          expert's ``down_proj``): normal(0, std / sqrt(2 · num_hidden_layers))
          (GPT-2's scaling, so the residual stream's variance does not grow with depth);
        - everything else (``embed_tokens``, q/k/v and MLA projections, routers,
          ``gate_proj``/``up_proj``/``gate_up_proj`` dense, shared and per expert,
          ``lm_head``): normal(0, std).

        Values are drawn in fp32 on the CPU from a generator seeded with the first 8 bytes
        of sha256(f"{seed}/{canonical_name}"), then copied into the parameter (any device
        and dtype). Stacked experts are drawn expert by expert under their per-expert Hub
        names, so expert e's weights do not depend on how many experts a module holds.
        Works after ``to_empty`` from a meta-device build, also on FSDP2-sharded
        parameters (DTensors): each rank draws a parameter whole and keeps its shard, so
        the model never needs to be unsharded on one device.

        Args:
            seed: The run's seed.
            skip_meta: leave parameters still on the meta device as they are (a pipeline
                rank materializes its own stages only); False initializes every one.
        """
        for fqn, param in self.named_parameters():
            if skip_meta and param.device.type == "meta":
                continue
            # The whole parameter in fp32 on the CPU, one at a time, so a sharded
            # parameter gets the same values as an unsharded one.
            full = torch.empty(param.shape, dtype=torch.float32)
            for name, tensor in self.to_canonical({fqn: full}).items():
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
            copy_whole_into(param, full)  # FSDP2 shards: this rank's piece only


def _experts_held(fqn: str, stack: Tensor) -> tuple[int, Tensor]:
    """``(index of the first, the experts)`` this rank holds of an expert stack [e, ...]:
    all of a plain tensor; of an FSDP2 shard, the local experts."""
    if not isinstance(stack, DTensor):
        return 0, stack
    shape, offset = compute_local_shape_and_global_offset(
        stack.shape, stack.device_mesh, stack.placements
    )
    local = stack.to_local()
    if tuple(shape[1:]) != tuple(stack.shape[1:]) or tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"{fqn} is sharded as {stack.placements}, which splits experts; shard expert "
            "stacks along dim 0 only (FSDP2's default Shard(0)), so each rank holds whole experts"
        )
    return offset[0], local


def copy_whole_into(target: Tensor, whole: Tensor) -> None:
    """Copies a whole tensor into ``target`` (cast to its dtype); into this rank's piece
    when ``target`` is an FSDP2 shard (DTensor), so the whole parameter is never gathered."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        piece = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        target.to_local().copy_(piece)
    else:
        target.copy_(whole)
