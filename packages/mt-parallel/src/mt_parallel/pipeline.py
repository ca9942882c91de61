"""The DualPipeV executor: runs one rank's action list (mt_parallel.dualpipev) on its two
stages (mt_parallel.pipeline_stages) for one step.

Legend: B batch, S sequence, D model dim, E experts, M micro-batches.

Actions, for a (chunk, micro-batch):

- ``Forward``: takes the previous stage's output (``torch.distributed`` from its rank, or
  directly when it is on this rank: the V's bottom, and everything when pp == 1), runs the
  stage with its linear layers' weight gradients set to defer into a
  :class:`~mt_ops.WeightGradQueue` of this (chunk, micro-batch), keeps what the backward
  needs, and hands its output to the next stage;
- ``BackwardInput``: backward from the next stage's input gradient (from the loss on the
  last stage), which computes the input gradients now and queues the weight gradients of
  the deferrable linears (``mt_ops.Linear`` swapped in by ``make_weight_grads_deferrable``,
  and ``GroupedLinear``, the experts); the other parameters (norms, router, embedding,
  the head read by the fused cross-entropy) get their gradients here, as deferring them
  would save little. Hands the input gradient to the previous stage;
- ``BackwardWeight``: flushes that (chunk, micro-batch)'s queue into ``param.grad``;
- ``Backward``: the two at once; ``ForwardBackward``: its forward, then its backward. Their
  overlap (one micro-batch's communication behind the other's compute) is still to come.

Loss. The last stage (rank 0) computes what ``run_microbatches`` does for each micro-batch,
``ce_sum / global_num_tokens + aux_loss / M``, with ``aux_loss`` from *every* MoE layer's
router statistics: each stage appends its layers' statistics (flattened into one fp32
vector that keeps the autograd graph of the probability sums) to those it received and
sends them on with the hidden states; their gradient comes back with the hidden states'
gradient. Every variant of ``CausalLM.auxiliary_losses`` is thus computed exactly as in one
process, including ``load_balancing="pooled"``, whose balancing term multiplies statistics
summed over all layers and so is no sum of per-stage terms. A model with
``router_stats_reducer`` set (dp/cp/ep) is refused by the split.

Communication. Each message has its own tag (kind, receiving stage, micro-batch, part),
so the order of sends and receives between two ranks need not match. Sends are
``isend``s, waited for at the end of the step; receives block where their data is needed.
A rank thus never waits on its own sends, which is the buffered-send model under which
``pipeline_sim.simulate`` shows DualPipeV's order deadlock-free. Blocking sends would not
do: a gloo ``send`` returns only once its receive is posted (seen here from 4 KB up), and
with ``dist.send`` in place of ``isend`` the pp = 2 test hangs, two ranks each sending to
the other. NCCL ignores tags: running this on GPUs needs matched batched P2P.

Results. The loss sums live on rank 0; with pp > 1 rank 0 broadcasts its
:class:`~mt_parallel.schedule.StepResult` over the pipeline group, so every rank returns
the same one.

Not here yet: the overlap of ``ForwardBackward``'s halves, composition with FSDP (one
gradient reduction per step), EP and CP, wiring into mt-train (which refuses pp > 1) and
checkpoints under pp (the stages keep the model's names; see pipeline_stages).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from mt_models.protocol import RouterStats
from mt_ops import WeightGradQueue, make_weight_grads_deferrable, set_weight_grad_queue
from mt_parallel.dualpipev import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    dualpipev_schedule,
    stage_of,
    stage_rank,
)
from mt_parallel.pipeline_stages import PipelineStage
from mt_parallel.schedule import MicroBatch, StepResult

__all__ = ["DualPipeVExecutor"]

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(RouterStats))
_COUNT_FIELDS = ("num_tokens", "num_tokens_B")  # int64 in RouterStats
_ACTIVATION, _GRADIENT = 0, 1


def _stats_shapes(num_experts: int, batch: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of RouterStats' fields, in field order, for E experts and B sequences."""
    shapes = {"tokens_per_expert_E": (num_experts,), "prob_sum_E": (num_experts,),
              "num_tokens": (), "z_sum": (), "tokens_per_expert_BE": (batch, num_experts),
              "prob_sum_BE": (batch, num_experts), "num_tokens_B": (batch,)}  # fmt: skip
    return tuple(shapes[name] for name in _STATS_FIELDS)


def _flatten_stats(router_stats: list[RouterStats], device: torch.device) -> Tensor:
    """All layers' statistics as one fp32 vector (counts are exact below 2**24 tokens)."""
    parts = []
    for stats in router_stats:
        parts += [getattr(stats, name).float().reshape(-1) for name in _STATS_FIELDS]
    return torch.cat(parts) if parts else torch.zeros(0, device=device)


def _unflatten_stats(flat: Tensor, experts: Sequence[int], batch: int) -> list[RouterStats]:
    """The inverse of :func:`_flatten_stats`, given each layer's E and the batch size."""
    out, offset = [], 0
    for num_experts in experts:
        fields = {}
        for name, shape in zip(_STATS_FIELDS, _stats_shapes(num_experts, batch), strict=True):
            piece = flat[offset : offset + math.prod(shape)].reshape(shape)
            offset += math.prod(shape)
            fields[name] = piece.long() if name in _COUNT_FIELDS else piece
        out.append(RouterStats(**fields))
    assert offset == flat.numel(), f"{offset=}, {flat.numel()=}, {experts=}, {batch=}"
    return out


def _stats_numel(experts: Sequence[int], batch: int) -> int:
    return sum(math.prod(s) for e in experts for s in _stats_shapes(e, batch))


@dataclass
class _Saved:
    """One (chunk, micro-batch)'s forward, kept for its backward."""

    inputs: list[Tensor]  # received leaves whose .grad goes back (none on stage 0)
    outputs: list[Tensor]  # what the backward starts from: the loss, or hidden and stats


@dataclass
class _Step:
    """Everything one step holds; dropped when the step ends."""

    microbatches: Sequence[MicroBatch]
    global_num_tokens: int
    ignore_index: int
    saved: dict[tuple[int, int], _Saved] = field(default_factory=dict)
    queues: dict[tuple[int, int], WeightGradQueue] = field(default_factory=dict)
    local: dict[tuple[int, int, int], list[Tensor]] = field(default_factory=dict)
    sends: list[tuple[dist.Work, Tensor]] = field(default_factory=list)
    losses: list = field(default_factory=list)  # LossOutput of each micro-batch, last stage


class DualPipeVExecutor:
    """Runs DualPipeV steps on one rank's two stages.

    Args:
        stages: ``split_for_dualpipev(model, rank, pp)``: (chunk 0, chunk 1). Their
            ``nn.Linear`` layers are swapped for deferrable ones (same parameters).
        rank: this rank's index in the pipeline group.
        pp: pipeline ranks (1: both stages here, no communication).
        group: the pipeline process group (None: the default group); unused when pp == 1.

    Attributes:
        weight_flushes: per ``BackwardWeight`` (or ``Backward``) of the last step, in order,
            ``(chunk, micro_batch, weight gradients flushed)``.
    """

    def __init__(
        self, stages: tuple[PipelineStage, PipelineStage], rank: int, pp: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:  # fmt: skip
        for chunk, stage in enumerate(stages):
            if stage.stage != stage_of(rank, chunk, pp) or stage.num_stages != 2 * pp:
                raise ValueError(
                    f"stages[{chunk}] is stage {stage.stage} of {stage.num_stages}; rank {rank} "
                    f"of pp={pp} runs stage {stage_of(rank, chunk, pp)} of {2 * pp} as chunk "
                    f"{chunk}: pass split_for_dualpipev(model, {rank}, {pp})"
                )
        if pp > 1 and dist.get_rank(group) != rank:
            raise ValueError(f"rank ({rank}) must be this process's rank in the pipeline group "
                             f"({dist.get_rank(group)})")  # fmt: skip
        self.stages, self.rank, self.pp, self.group = stages, rank, pp, group
        for stage in stages:
            make_weight_grads_deferrable(stage)
        param = next(stages[0].parameters())
        self.device, self.dtype = param.device, param.dtype  # of the hidden states
        self.weight_flushes: list[tuple[int, int, int]] = []

    def step(
        self, microbatches: Sequence[MicroBatch], global_num_tokens: int, *,
        ignore_index: int = -100,
    ) -> StepResult:  # fmt: skip
        """Runs this rank's actions of one step, accumulating gradients into ``.grad``.

        Args:
            microbatches: the step's micro-batches, the same on every pipeline rank (all
                stages need their shapes and positions; only rank 0 reads ids and labels).
                At least 2·pp.
            global_num_tokens: valid labels of the whole step, as for ``run_microbatches``.
            ignore_index: label value that carries no loss.

        Returns:
            The step's loss sums as ``run_microbatches`` returns them, on every rank.
        """
        if global_num_tokens <= 0:
            raise ValueError(
                f"global_num_tokens ({global_num_tokens}) must be positive: the number of "
                f"labels that are not ignore_index ({ignore_index}) in the whole step"
            )
        actions = dualpipev_schedule(self.pp, len(microbatches))[self.rank]
        step = _Step(microbatches, global_num_tokens, ignore_index)
        self.weight_flushes = []
        for action in actions:
            self._run(action, step)
        for work, _ in step.sends:
            work.wait()
        left = [f"W{c}[{m}] ({len(q)} pending)" for (c, m), q in step.queues.items()]
        left += [f"B{c}[{m}]" for c, m in step.saved]
        if left or step.local:
            raise RuntimeError(f"rank {self.rank}: the step ended with work left: {left}, "
                               f"unconsumed hand-overs {sorted(step.local)}")  # fmt: skip
        return self._result(step)

    def _run(self, action: Action, step: _Step) -> None:
        if isinstance(action, ForwardBackward):
            # Still one after the other: overlapping their phases is the next step.
            self._run(action.forward, step)
            self._run(action.backward, step)
        elif isinstance(action, Forward):
            self._forward(action.chunk, action.micro_batch, step)
        elif isinstance(action, BackwardInput):
            self._backward_input(action.chunk, action.micro_batch, step)
        elif isinstance(action, BackwardWeight):
            self._backward_weight(action.chunk, action.micro_batch, step)
        elif isinstance(action, Backward):
            self._backward_input(action.chunk, action.micro_batch, step)
            self._backward_weight(action.chunk, action.micro_batch, step)
        else:
            raise ValueError(f"rank {self.rank}: {action!r} is not a DualPipeV action")

    def _forward(self, chunk: int, mb: int, step: _Step) -> None:
        stage, data = self.stages[chunk], step.microbatches[mb]
        batch, seq = data.input_ids.shape
        assert batch * seq < 2**24, f"{batch=}, {seq=}: token counts are sent as exact fp32"
        if stage.is_first:
            x, inputs = data.input_ids, []
        else:
            specs = [((batch, seq, stage.hidden_size), self.dtype),
                     ((_stats_numel(stage.experts_before, batch),), torch.float32)]  # fmt: skip
            inputs = [t.requires_grad_() for t in self._receive(_ACTIVATION, stage.stage, mb,
                                                                specs, step)]  # fmt: skip
            x = inputs[0]
        queue = step.queues[(chunk, mb)] = WeightGradQueue()
        set_weight_grad_queue(stage, queue)  # read by each linear's autograd at forward time
        try:
            out = stage(x, data.positions)
        finally:
            set_weight_grad_queue(stage, None)
        stats_in = inputs[1] if inputs else torch.zeros(0, device=self.device)
        stats = torch.cat([stats_in, _flatten_stats(out.router_stats, self.device)])
        if stage.is_last:
            experts = stage.experts_before + stage.experts_here
            loss_out = stage.loss(out.hidden_BSD, _unflatten_stats(stats, experts, batch),
                                  data.labels, step.ignore_index)  # fmt: skip
            loss = (loss_out.ce_sum / step.global_num_tokens
                    + loss_out.aux_loss / len(step.microbatches))  # fmt: skip
            step.losses.append(loss_out)
            step.saved[(chunk, mb)] = _Saved(inputs, [loss])
        else:
            step.saved[(chunk, mb)] = _Saved(inputs, [out.hidden_BSD, stats])
            self._hand_over(_ACTIVATION, stage.stage + 1, mb,
                            [out.hidden_BSD.detach(), stats.detach()], step)  # fmt: skip

    def _backward_input(self, chunk: int, mb: int, step: _Step) -> None:
        stage = self.stages[chunk]
        saved = step.saved.pop((chunk, mb))
        if stage.is_last:
            grads = [None]  # d loss / d loss = 1
        else:
            specs = [(tuple(t.shape), t.dtype) for t in saved.outputs]
            grads = self._receive(_GRADIENT, stage.stage, mb, specs, step)
        pairs = [(t, g) for t, g in zip(saved.outputs, grads, strict=True) if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if not stage.is_first:
            grads_in = [t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in saved.inputs]  # fmt: skip
            self._hand_over(_GRADIENT, stage.stage - 1, mb, grads_in, step)

    def _backward_weight(self, chunk: int, mb: int, step: _Step) -> None:
        queue = step.queues.pop((chunk, mb), None)
        if queue is None:
            raise RuntimeError(f"rank {self.rank}: W{chunk}[{mb}] without a pending F/B "
                               "(run twice, or before its forward)")  # fmt: skip
        self.weight_flushes.append((chunk, mb, queue.flush()))

    def _tag(self, kind: int, stage: int, mb: int, part: int) -> int:
        """A distinct tag for each message of a step, keyed by its receiving stage."""
        return ((mb * 2 * self.pp + stage) * 2 + kind) * 2 + part

    def _hand_over(self, kind: int, stage: int, mb: int, tensors: list[Tensor],
                   step: _Step) -> None:  # fmt: skip
        """Gives `tensors` to `stage` (the receiver): locally, or by isend to its rank."""
        rank, _ = stage_rank(stage, self.pp)
        if rank == self.rank:
            step.local[(kind, stage, mb)] = tensors
            return
        for part, tensor in enumerate(tensors):
            if tensor.numel():
                tensor = tensor.contiguous()
                work = dist.isend(tensor, group=self.group, group_dst=rank,
                                  tag=self._tag(kind, stage, mb, part))  # fmt: skip
                step.sends.append((work, tensor))  # the tensor lives until the send is done

    def _receive(self, kind: int, stage: int, mb: int, specs: list, step: _Step) -> list[Tensor]:
        """What `stage` receives for `mb`: from this rank's hand-over, or from the peer."""
        local = step.local.pop((kind, stage, mb), None)
        if local is not None:
            return local
        source = stage - 1 if kind == _ACTIVATION else stage + 1
        rank, _ = stage_rank(source, self.pp)
        assert rank != self.rank, f"stage {source} on this rank has not handed over {mb=}"
        out = []
        for part, (shape, dtype) in enumerate(specs):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            if tensor.numel():
                dist.recv(tensor, group=self.group, group_src=rank,
                          tag=self._tag(kind, stage, mb, part))  # fmt: skip
            out.append(tensor)
        return out

    def _result(self, step: _Step) -> StepResult:
        """The step's StepResult from rank 0's losses, broadcast to every pipeline rank."""
        result = None
        if step.losses:
            losses = {}
            for name in step.losses[0].losses:
                losses[name] = float(torch.stack([o.losses[name].detach().double()
                                                  for o in step.losses]).mean())  # fmt: skip
            result = StepResult(
                ce_sum=torch.stack([o.ce_sum.detach().double() for o in step.losses]).sum().cpu(),
                num_tokens=torch.stack([o.num_tokens.detach() for o in step.losses]).sum().cpu(),
                aux_loss=torch.stack([o.aux_loss.detach().double()
                                      for o in step.losses]).mean().cpu(),
                losses=losses,
            )  # fmt: skip
        if self.pp > 1:
            box = [result]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            result = box[0]
        assert result is not None, f"rank {self.rank}: no loss reached this rank"
        return result
