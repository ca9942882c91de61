"""A causal LM cut into the 2·pp stages of a DualPipeV V (mt_parallel.dualpipev).

Legend: B batch, S sequence, T tokens (B·S), D model dim, E experts.

:func:`split_for_dualpipev` gives rank r of pp its two stages: chunk 0 is stage r, chunk 1
is stage 2·pp−1−r. Stage 0 starts with the embedding, stage 2·pp−1 ends with the final
norm and the loss (output head, cross-entropy and the router losses), and the decoder
layers are split as evenly as possible (:func:`stage_layers`).

Names stay the model's own. A stage *shares* the model's modules (nothing is copied) and
holds them at the model's attribute paths: ``model.embed_tokens``, ``model.layers.<i>``
(a ``ModuleDict`` keyed by the layer's index in the whole model), ``model.norm`` and
``lm_head``. ``stage.named_parameters()`` therefore yields exactly the whole model's
FQNs (``model.layers.5.mlp.experts.gate_proj.weight``), so a checkpoint or optimizer
state written per stage has the keys of the unsplit model, and a caller maps a name back
with ``model.get_parameter(name)`` or renames to Hub keys with ``model.to_canonical``.
With tied embeddings the last stage also holds ``model.embed_tokens`` (both stages are on
rank 0, the same Parameter); :func:`rank_parameters` lists a rank's parameters once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from mt_models.base import CausalLM, LossOutput
from mt_models.protocol import RouterStats
from mt_ops import linear_cross_entropy, make_weight_grads_deferrable
from mt_parallel.dualpipev import stage_of

__all__ = ["PipelineStage", "StageOutput", "rank_parameters", "split_for_dualpipev", "stage_layers"]


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The decoder layers of each of the 2·pp stages, in stage order.

    Every stage gets ``num_layers // (2·pp)`` layers; the ``num_layers mod 2·pp`` left over
    go one each to the stages nearest the V's bottom (stage pp−1, then pp, pp−2, pp+1, ...),
    away from stages 0 and 2·pp−1, whose rank 0 also runs the embedding and the loss.

    Args:
        num_layers: decoder layers of the model (``num_hidden_layers``).
        pp: pipeline ranks.

    Returns:
        ``2·pp`` consecutive ranges covering ``range(num_layers)``.
    """
    num_stages = 2 * pp
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} decoder layers (num_hidden_layers) but DualPipeV "
            f"with pp={pp} has {num_stages} stages of at least one layer each; use pp <= "
            f"{max(num_layers // 2, 1)} or a model with at least {num_stages} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    by_depth = sorted(range(num_stages), key=lambda s: (abs(2 * s - (num_stages - 1)), s))
    sizes = [base + (s in by_depth[:extra]) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _num_experts(layer: nn.Module) -> int:
    """E of an MoE layer's router statistics, 0 for a dense layer (no dispatcher)."""
    dispatcher = getattr(layer, "dispatcher", None)
    return 0 if dispatcher is None else dispatcher.num_experts


@dataclass(frozen=True)
class StageOutput:
    """What a stage's forward produces.

    Attributes:
        hidden_BSD: the hidden states after the stage's layers [B, S, D] (final-normed on
            the last stage).
        router_stats: the router statistics of the stage's MoE layers, in layer order.
    """

    hidden_BSD: Tensor
    router_stats: list[RouterStats]


# A pytree node, so FSDP2 finds the tensors of a sharded stage's output (its pre-backward
# hooks), as mt_models registers its layers' outputs.
torch.export.register_dataclass(StageOutput)


class PipelineStage(nn.Module):
    """One stage of a split :class:`~mt_models.base.CausalLM`, sharing its modules.

    Attributes:
        stage: the stage index, 0 ... num_stages−1.
        num_stages: 2·pp.
        layer_ids: the model's indices of the stage's decoder layers.
        experts_before: E of each MoE layer of the earlier stages, in layer order (what
            the router statistics arriving with the stage's input hold).
        experts_here: E of each MoE layer of this stage.
        hidden_size: D.
    """

    def __init__(self, model: CausalLM, stage: int, num_stages: int, layer_ids: range):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.layer_ids = tuple(layer_ids)
        layers = model.model.layers
        experts = [_num_experts(layer) for layer in layers]
        self.experts_before = tuple(e for e in experts[: layer_ids.start] if e > 0)
        self.experts_here = tuple(e for e in experts[layer_ids.start : layer_ids.stop] if e > 0)
        self.hidden_size = model.config.hidden_size
        self.model = nn.Module()  # the model's own paths: model.embed_tokens, model.layers.<i>
        if self.is_first or (self.is_last and model.lm_head is None):
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): layers[i] for i in layer_ids})
        if self.is_last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
            # The model's loss rules, bound to what they read (its config; the reducer,
            # None as the split requires) rather than to the model, which would keep every
            # other stage's layers alive on this rank.
            rules = SimpleNamespace(config=model.config, router_stats_reducer=None)
            self._auxiliary_losses = partial(type(model).auxiliary_losses, rules)

    @property
    def is_first(self) -> bool:
        """Whether the stage starts with the embedding (takes token ids)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether the stage ends with the final norm and the loss."""
        return self.stage == self.num_stages - 1

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> StageOutput:
        """Runs the stage: embedding (first stage), its layers, final norm (last stage).

        Args:
            x: token ids [B, S] on the first stage, else the previous stage's hidden
                states [B, S, D].
            position_ids: token positions [S] or [B, S]; None for ``arange(S)``.

        Returns:
            The :class:`StageOutput`.
        """
        h_BSD = self.model.embed_tokens(x) if self.is_first else x
        router_stats = []
        for layer in self.model.layers.values():
            out = layer(h_BSD, position_ids)
            h_BSD = out.hidden_BSD
            if out.router_stats is not None:
                router_stats.append(out.router_stats)
        if self.is_last:
            h_BSD = self.model.norm(h_BSD)
        return StageOutput(h_BSD, router_stats)

    def loss(
        self, hidden_BSD: Tensor, router_stats: list[RouterStats], labels_BS: Tensor,
        ignore_index: int = -100,
    ) -> LossOutput:  # fmt: skip
        """The last stage's loss, as ``CausalLM.loss`` computes it from the final hidden
        states and every MoE layer's router statistics (of all stages, in layer order).

        Args:
            hidden_BSD: the final-normed hidden states [B, S, D].
            router_stats: each MoE layer's statistics, layer 0 first.
            labels_BS: target ids [B, S]; ``ignore_index`` entries are skipped.
            ignore_index: label value excluded from the loss.

        Returns:
            The :class:`~mt_models.base.LossOutput`.
        """
        if not self.is_last:
            raise ValueError(
                f"PipelineStage.loss: stage {self.stage} of {self.num_stages} is not the last "
                f"(stage {self.num_stages - 1}), which holds the head; call loss on that one"
            )
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        hidden_TD = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
        ce_sum, num_tokens = linear_cross_entropy(
            hidden_TD, weight, labels_BS.reshape(-1), ignore_index=ignore_index
        )
        aux_loss, losses = self._auxiliary_losses(router_stats, hidden_TD.device)
        return LossOutput(ce_sum, num_tokens, aux_loss, router_stats, losses)


def split_for_dualpipev(model: CausalLM, rank: int, pp: int) -> tuple[PipelineStage, PipelineStage]:
    """Rank `rank`'s two stages of `model` cut into 2·pp (see the module docstring).

    Args:
        model: a causal LM (``model.embed_tokens``/``layers``/``norm``, ``lm_head``); its
            modules are shared with the stages, not copied. Its ``nn.Linear`` layers are
            first swapped, in the model, for deferrable ones (``make_weight_grads_
            deferrable``: same parameters), so that model and stages keep holding the same
            modules (a stage that swapped its head alone would hold another module than
            the model, whose initialization or sharding would then miss it). Split it
            before anything else wraps its modules.
        rank: this rank's index in the pipeline, 0 ... pp−1.
        pp: pipeline ranks.

    Returns:
        ``(chunk 0, chunk 1)``: stages r and 2·pp−1−r.
    """
    if not 0 <= rank < pp:
        raise ValueError(f"rank ({rank}) must be in 0 ... pp-1 = {pp - 1}")
    if model.router_stats_reducer is not None:
        raise ValueError(
            "model.router_stats_reducer is set (router statistics reduced over data-parallel "
            "ranks inside the model): the pipeline reduces them at its last stage instead; "
            "split a model without it and pass the reducer to DualPipeVExecutor "
            "(stats_reducer)"
        )
    ranges = stage_layers(len(model.model.layers), pp)
    make_weight_grads_deferrable(model)
    return tuple(
        PipelineStage(model, stage, 2 * pp, ranges[stage])
        for stage in (stage_of(rank, 0, pp), stage_of(rank, 1, pp))
    )


def rank_parameters(stages: tuple[PipelineStage, ...]) -> Iterator[tuple[str, nn.Parameter]]:
    """A rank's ``(name, parameter)`` pairs over its stages, each parameter once (a tied
    embedding is in stage 0 and stage 2·pp−1, both on rank 0).

    Args:
        stages: the rank's stages.

    Yields:
        The model's FQN and the parameter.
    """
    seen: set[int] = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param
