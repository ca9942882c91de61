"""The plain micro-batch schedule, used when there is no pipeline (pp == 1).

Each rank runs forward and backward over its micro-batches in turn and lets the
gradients accumulate. The language-model loss of every micro-batch is a *sum* over its
valid tokens divided by the number of valid tokens in the whole global step (all
micro-batches, all ranks), so the accumulated gradient is the gradient of the
global-batch mean loss whatever the layout (ARCHITECTURE.md §5).

Under FSDP2 every micro-batch's backward reduce-scatters its gradients by default
(``grad_reduce="microbatch"``): gradients stay sharded, at the cost of one reduction per
micro-batch. ``grad_reduce="step"`` reduces once per step, after the last micro-batch,
and holds the unsharded gradients of every FSDP-managed parameter in between (memory of
the rank's whole unsharded model in the gradient dtype): right for small models or few
micro-batches, not for one whose unsharded gradients do not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

GRAD_REDUCE = ("microbatch", "step")


@dataclass
class MicroBatch:
    """Input ids and labels of one micro-batch, both [B, S], and optional positions.

    `positions` (int64) are the global token positions [S] when the sequence is a
    context-parallel slice, or per-document positions [B, S] of packed samples (document
    masking, cp = 1 only: a position that is not its predecessor plus 1 starts a document);
    None means 0..S-1, one document per sample.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass
class StepResult:
    """Detached sums over the micro-batches this rank ran.

    Attributes:
        ce_sum: summed token cross-entropy (fp64 scalar on the CPU).
        num_tokens: number of tokens that carried a label (int64 scalar on the CPU).
        aux_loss: the weighted auxiliary loss, averaged over micro-batches (fp64 scalar
            on the CPU).
        losses: its unweighted terms (e.g. `load_balancing_loss`, `router_z_loss`, as the
            model's `LossOutput.losses` names them), averaged over micro-batches.
    """

    ce_sum: torch.Tensor
    num_tokens: torch.Tensor
    aux_loss: torch.Tensor
    losses: dict[str, float] = field(default_factory=dict)


class LossSums:
    """The detached loss terms of each micro-batch a rank ran, reduced to its `StepResult`.

    They stay on the device until `result`: one host transfer per step, not one per
    micro-batch; and only the detached terms, not the micro-batch's loss output (with its
    router statistics), live until the step ends.
    """

    def __init__(self) -> None:
        self._ce_sums: list[torch.Tensor] = []
        self._token_counts: list[torch.Tensor] = []
        self._aux_losses: list[torch.Tensor] = []
        self._terms: dict[str, list[torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._ce_sums)

    def add(self, out) -> None:
        """Records one micro-batch's `ce_sum`, `num_tokens`, `aux_loss` and named `losses`
        (an mt_models.LossOutput)."""
        self._ce_sums.append(out.ce_sum.detach().double())
        self._token_counts.append(out.num_tokens.detach())
        self._aux_losses.append(out.aux_loss.detach().double())
        for name, value in getattr(out, "losses", {}).items():
            self._terms.setdefault(name, []).append(value.detach().double())

    def result(self) -> StepResult:
        """Summed cross-entropy and tokens; aux loss and its terms averaged over the
        micro-batches (zeros when there were none)."""
        if not self._ce_sums:
            zero = torch.zeros((), dtype=torch.float64)
            return StepResult(ce_sum=zero, num_tokens=zero.long(), aux_loss=zero)
        return StepResult(
            ce_sum=torch.stack(self._ce_sums).sum().cpu(),
            num_tokens=torch.stack(self._token_counts).sum().cpu(),
            aux_loss=torch.stack(self._aux_losses).mean().cpu(),
            losses={name: float(torch.stack(v).mean()) for name, v in self._terms.items()},
        )


def run_microbatches(
    model: nn.Module,
    microbatches: Sequence[MicroBatch],
    global_num_tokens: int,
    *,
    ignore_index: int = -100,
    grad_reduce: str = "microbatch",
) -> StepResult:
    """Runs forward and backward over micro-batches, accumulating gradients.

    Args:
        model: a causal LM with `loss(input_ids, labels, ignore_index=...)` returning
            `ce_sum`, `num_tokens` and `aux_loss` (mt_models.LossOutput).
        microbatches: this rank's share of the global batch.
        global_num_tokens: valid labels in the global batch over all ranks; each
            micro-batch's summed cross-entropy is divided by it.
        ignore_index: label value that carries no loss.
        grad_reduce: "microbatch" (FSDP2 reduce-scatters after every micro-batch) or
            "step" (only after the last one; see the module docstring).

    Returns:
        The detached loss sums, for logging.
    """
    if global_num_tokens <= 0:
        raise ValueError(
            f"global_num_tokens ({global_num_tokens}) must be positive: pass the number of "
            f"labels that are not ignore_index ({ignore_index}) in the whole step, summed over "
            "all micro-batches and ranks; 0 means every label of the step is ignored, so "
            "there is no loss to train on (skip that batch)"
        )
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"grad_reduce ({grad_reduce!r}) must be one of {GRAD_REDUCE}")
    defer = grad_reduce == "step" and isinstance(model, FSDPModule)
    sums = LossSums()
    try:
        for i, mb in enumerate(microbatches):
            if defer:  # reduce-scatter only in the last micro-batch's backward
                model.set_requires_gradient_sync(i == len(microbatches) - 1)
            if mb.positions is None:
                out = model.loss(mb.input_ids, mb.labels, ignore_index=ignore_index)
            else:
                out = model.loss(
                    mb.input_ids, mb.labels, ignore_index=ignore_index, position_ids=mb.positions
                )
            # The aux loss is a per-micro-batch mean already; average it over micro-batches.
            loss = out.ce_sum / global_num_tokens + out.aux_loss / len(microbatches)
            loss.backward()
            sums.add(out)
    finally:
        if defer:  # a micro-batch that raised must not leave later steps unreduced
            model.set_requires_gradient_sync(True)
    return sums.result()
