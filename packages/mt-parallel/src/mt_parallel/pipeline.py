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

Communication: without tags, in one order. NCCL has no tags (gloo's stay 0): between two
ranks, messages match in the order the operations are issued. Every rank computes the same
global order of the step's messages between ranks (:func:`~mt_parallel.pipeline_comm.
message_plan`: the ranks' action lists run in one process, each action once the messages it
needs were sent) and issues its operations in it. Before each action, one
``batch_isend_irecv`` posts the receives of every message to this rank that comes earlier
in the order and is not posted yet: those the action needs and any that come before them
(received ahead, into buffers kept for a later action). After a stage's forward or input
backward, one batch sends its output (hidden states and router statistics: two operations,
none for an empty statistics vector on either side); the sends are waited for at the end of
the step, the receives just before their data is used.

Why this matches and cannot deadlock. The model: a send may not complete before its
receive runs (NCCL; gloo's blocking ``send`` too, seen from 4 KB up); a rank's operations
may run one after another, a batch completing when all its operations have (NCCL's stream;
within a batch they progress together); a rank waits only for a receive whose data it is
about to use (NCCL: its compute stream; gloo: its thread). (1) Each rank issues its sends
and receives in the global order, so for every ordered pair (a, b) the k-th send from a to
b and the k-th receive b posts from a are the same message: same shapes, same data.
(2) Take the earliest message of the order not yet complete. Before it, its sender and
its receiver issue only operations earlier in the order, and wait only for receives they
posted before their current action, also earlier (the receives an action posts precede
its sends in the order); the data sent was computed from such receives. All of that is
complete, so both ranks reach the message, the receive is posted, the data exists, and it
completes; by induction every message does. The one-process run exists because
DualPipeV's lists are deadlock-free when sends do not block (:func:`~mt_parallel.
pipeline_sim.simulate`); the plan asserts it. A batch holds consecutive operations of the
order, so batching the receives before an action changes nothing in (2). With pp > 1 the
constructor runs one all-reduce over the group, so that the NCCL communicator exists on
every rank before the first batch (torch asks that a group's first ``batch_isend_irecv``
include all its ranks).

What it costs: a message received ahead holds its buffer from its post to its action (at
most 3 such messages per rank at once for pp = 2 to 8 and 4·pp micro-batches), and
a rank's send queues behind receives posted before it (on the stream under NCCL); the
overlap of communication with computation is still to come.

Results. The loss sums live on rank 0; with pp > 1 rank 0 broadcasts its
:class:`~mt_parallel.schedule.StepResult` over the pipeline group, so every rank returns
the same one.

Data parallelism. With the stages sharded by FSDP2 over the dp axis
(:func:`~mt_parallel.fsdp.apply_fsdp_to_stages`), each dp replica runs its own pipeline on
its rows of every micro-batch: the gradient reduction is held through the step's backward
passes and deferred weight gradients and run once, after the last action
(:func:`~mt_parallel.fsdp.hold_gradient_reduction`, :func:`~mt_parallel.fsdp.
reduce_held_gradients`), and the last stage reduces each layer's router statistics over
the replicas (``stats_reducer``) before the loss, so the load-balancing loss is the whole
micro-batch's. ``global_num_tokens`` counts the labels of every replica; the loss sums of
the returned :class:`~mt_parallel.schedule.StepResult` are the replica's own.

mt-train's pretrain runs it with pp (and dp, cp, ep), each rank optimizing and
checkpointing its stages' parameters under the model's names (``rank_parameters``), so
checkpoints keep the one-process layout. Not here yet: the overlap of
``ForwardBackward``'s halves. Expert and context parallelism need nothing here: each
(dp, cp, ep) coordinate runs its own pipeline with its slice of the experts and of the
sequences, and the layers' all-to-alls and key/value exchanges meet those of the other
pipelines at the same action, every pipeline running the same schedule.

Validation: :meth:`~DualPipeVExecutor.evaluate` runs micro-batches forward only, each
through the 2·pp stages in turn (no overlap: held-out batches are few).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

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
from mt_parallel.fsdp import (
    fold_held_gradients,
    fsdp_param_dtype,
    hold_gradient_reduction,
    reduce_held_gradients,
)
from mt_parallel.pipeline_comm import ACTIVATION, GRADIENT, Message, message_plan
from mt_parallel.pipeline_stages import PipelineStage
from mt_parallel.schedule import LossSums, MicroBatch, StepResult

__all__ = ["MICRO_BATCH_TOKEN_LIMIT", "DualPipeVExecutor"]

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(RouterStats))
_COUNT_FIELDS = ("num_tokens", "num_tokens_B")  # int64 in RouterStats
# A micro-batch must hold fewer tokens than this: the statistics travel as fp32 (below).
MICRO_BATCH_TOKEN_LIMIT = 2**24


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
    # Posted receives by message key: the buffers and their pending works.
    incoming: dict[tuple[int, int, int], tuple[list[Tensor], list]] = field(default_factory=dict)
    sends: list[tuple[list, list[Tensor]]] = field(default_factory=list)  # works, tensors
    losses: LossSums = field(default_factory=LossSums)  # last stage: each micro-batch's


class DualPipeVExecutor:
    """Runs DualPipeV steps on one rank's two stages.

    Args:
        stages: ``split_for_dualpipev(model, rank, pp)``: (chunk 0, chunk 1). Their
            ``nn.Linear`` layers are swapped for deferrable ones (same parameters).
        rank: this rank's index in the pipeline group.
        pp: pipeline ranks (1: both stages here, no communication).
        group: the pipeline process group (None: the default group); unused when pp == 1.
        stats_reducer: makes one layer's router statistics those of the whole micro-batch
            (``partial(reduce_router_stats, ...)`` over the dp replicas; None: this
            replica's are the whole micro-batch's).

    Attributes:
        weight_flushes: per ``BackwardWeight`` (or ``Backward``) of the last step, in order,
            ``(chunk, micro_batch, weight gradients flushed)``.
    """

    def __init__(
        self, stages: tuple[PipelineStage, PipelineStage], rank: int, pp: int,
        group: dist.ProcessGroup | None = None, *,
        stats_reducer: Callable[[RouterStats], RouterStats] | None = None,
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
        self.stats_reducer = stats_reducer
        for stage in stages:
            make_weight_grads_deferrable(stage)  # (a no-op on linears already swapped)
        param = next(stages[0].parameters())
        self.device = param.device
        # The hidden states' dtype: what the stages compute in (FSDP2's param_dtype when they
        # are sharded with one, else the parameters' dtype).
        self.dtype = fsdp_param_dtype(stages[0]) or param.dtype
        if pp > 1:  # every rank joins the communicator before the first batched P2P
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        self.weight_flushes: list[tuple[int, int, int]] = []
        self._plans: dict[int, tuple[list[Action], list]] = {}

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

        Raises:
            ValueError: global_num_tokens is not positive, a micro-batch holds 2**24 tokens
                or more, or there are fewer than 2·pp micro-batches; before any work.
        """
        if global_num_tokens <= 0:
            raise ValueError(
                f"global_num_tokens ({global_num_tokens}) must be positive: the number of "
                f"labels that are not ignore_index ({ignore_index}) in the whole step"
            )
        for i, mb in enumerate(microbatches):  # before any work, on every rank alike
            batch, seq = mb.input_ids.shape
            if batch * seq >= MICRO_BATCH_TOKEN_LIMIT:
                raise ValueError(
                    f"microbatches[{i}] holds {batch} x {seq} = {batch * seq} tokens; the "
                    "pipeline sends token counts as fp32, exact below 2**24 (16777216): use "
                    "smaller micro-batches"
                )
        actions, plan = self._plan(len(microbatches))
        step = _Step(microbatches, global_num_tokens, ignore_index)
        self.weight_flushes = []
        roots = [stage for stage in self.stages if isinstance(stage, FSDPModule)]
        for root in roots:
            hold_gradient_reduction(root)
        for action, receives in zip(actions, plan, strict=True):
            self._drop_finished_sends(step)
            self._post_receives(receives, step)
            self._run(action, step)
        for works, _ in step.sends:
            for work in works:
                work.wait()
        left = [f"W{c}[{m}] ({len(q)} pending)" for (c, m), q in step.queues.items()]
        left += [f"B{c}[{m}]" for c, m in step.saved]
        if left or step.local or step.incoming:
            raise RuntimeError(f"rank {self.rank}: the step ended with work left: {left}, "
                               f"unconsumed hand-overs {sorted(step.local)}, "
                               f"unconsumed receives {sorted(step.incoming)}")  # fmt: skip
        for root in roots:  # chunk 0, then chunk 1: the same order on every replica
            reduce_held_gradients(root)
        return self._result(step)

    @torch.no_grad()
    def evaluate(
        self, microbatches: Sequence[MicroBatch], *, ignore_index: int = -100
    ) -> tuple[Tensor, Tensor]:
        """Forward only (validation): each micro-batch through the V's 2·pp stages in turn,
        the hidden states sent with blocking point-to-point operations that every rank
        issues in the same (micro-batch, stage) order, so they match and cannot deadlock.
        No router statistics travel: the loss is the cross-entropy alone.

        Args:
            microbatches: as for :meth:`step` (any number).
            ignore_index: label value that carries no loss.

        Returns:
            ``(ce_sum fp64, num_tokens int64)`` of the replica's micro-batches on the rank
            that holds the last stage (rank 0), zeros on the others: a sum over every rank
            adds up the replicas.
        """
        ce_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        num_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        num_stages = 2 * self.pp
        for data in microbatches:
            batch, seq = data.input_ids.shape
            hidden = None
            for stage in range(num_stages):
                rank, chunk = stage_rank(stage, self.pp)
                previous = stage_rank(stage - 1, self.pp)[0] if stage else rank
                if rank != self.rank:
                    if previous == self.rank:  # this rank ran the stage before: hand over
                        dist.send(hidden.contiguous(), group=self.group, group_dst=rank)
                    continue
                if stage == 0:
                    x = data.input_ids
                elif previous == self.rank:
                    x = hidden
                else:
                    x = torch.empty((batch, seq, self.stages[chunk].hidden_size),
                                    dtype=self.dtype, device=self.device)  # fmt: skip
                    dist.recv(x, group=self.group, group_src=previous)
                out = self.stages[chunk](x, data.positions)
                hidden = out.hidden_BSD
                if stage == num_stages - 1:
                    loss = self.stages[chunk].loss(hidden, [], data.labels, ignore_index)
                    ce_sum += loss.ce_sum.double()
                    num_tokens += loss.num_tokens
                elif stage_rank(stage + 1, self.pp)[0] != self.rank:
                    assert hidden.dtype == self.dtype, (
                        f"rank {self.rank}: stage {stage} gives {hidden.dtype} hidden states, "
                        f"stage {stage + 1} receives {self.dtype}"
                    )
        return ce_sum, num_tokens

    def _plan(self, num_micro_batches: int) -> tuple[list[Action], list]:
        """This rank's actions and the receives to post before each, computed once per
        micro-batch count (they depend on nothing else; the plan replays every rank)."""
        if num_micro_batches not in self._plans:
            schedule = dualpipev_schedule(self.pp, num_micro_batches)
            plan = message_plan(schedule, self.pp)[self.rank]
            self._plans[num_micro_batches] = (schedule[self.rank], plan)
        return self._plans[num_micro_batches]

    @staticmethod
    def _drop_finished_sends(step: _Step) -> None:
        """Lets go of sent tensors whose sends completed. Holding every one until the step
        ends would keep each micro-batch's activations and gradients alive after its
        backward, growing with the micro-batch count instead of the 2·pp+1 the schedule
        needs."""
        step.sends = [(works, tensors) for works, tensors in step.sends
                      if not all(work.is_completed() for work in works)]  # fmt: skip

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
        batch = data.input_ids.shape[0]  # batch * seq < 2**24: checked by step()
        if stage.is_first:
            x, inputs = data.input_ids, []
        else:
            received = self._receive(ACTIVATION, stage.stage, mb, step)
            inputs = [t.requires_grad_() for t in received]
            x = inputs[0]
        queue = step.queues[(chunk, mb)] = WeightGradQueue()
        # Read by each linear's autograd at forward time. Under FSDP2 the step holds the
        # gradient reduction until its end (step()), after every flush.
        set_weight_grad_queue(stage, queue, fsdp_reduction_held=isinstance(stage, FSDPModule))
        try:
            out = stage(x, data.positions)
        finally:
            set_weight_grad_queue(stage, None)
        stats_in = inputs[1] if inputs else torch.zeros(0, device=self.device)
        stats = torch.cat([stats_in, _flatten_stats(out.router_stats, self.device)])
        if stage.is_last:
            experts = stage.experts_before + stage.experts_here
            router_stats = _unflatten_stats(stats, experts, batch)
            if self.stats_reducer is not None:
                router_stats = [self.stats_reducer(layer) for layer in router_stats]
            loss_out = stage.loss(out.hidden_BSD, router_stats, data.labels, step.ignore_index)
            loss = (loss_out.ce_sum / step.global_num_tokens
                    + loss_out.aux_loss / len(step.microbatches))  # fmt: skip
            step.losses.add(loss_out)
            step.saved[(chunk, mb)] = _Saved(inputs, [loss])
        else:
            step.saved[(chunk, mb)] = _Saved(inputs, [out.hidden_BSD, stats])
            self._hand_over(ACTIVATION, stage.stage + 1, mb,
                            [out.hidden_BSD.detach(), stats.detach()], step)  # fmt: skip

    def _backward_input(self, chunk: int, mb: int, step: _Step) -> None:
        stage = self.stages[chunk]
        saved = step.saved.pop((chunk, mb))
        if stage.is_last:
            grads = [None]  # d loss / d loss = 1
        else:
            grads = self._receive(GRADIENT, stage.stage, mb, step)
            got = [(tuple(g.shape), g.dtype) for g in grads]
            want = [(tuple(t.shape), t.dtype) for t in saved.outputs]
            assert got == want, f"rank {self.rank}, stage {stage.stage}, {mb=}: {got=}, {want=}"
        pairs = [(t, g) for t, g in zip(saved.outputs, grads, strict=True) if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if not stage.is_first:
            grads_in = [t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in saved.inputs]  # fmt: skip
            self._hand_over(GRADIENT, stage.stage - 1, mb, grads_in, step)

    def _backward_weight(self, chunk: int, mb: int, step: _Step) -> None:
        queue = step.queues.pop((chunk, mb), None)
        if queue is None:
            raise RuntimeError(f"rank {self.rank}: W{chunk}[{mb}] without a pending F/B "
                               "(run twice, or before its forward)")  # fmt: skip
        self.weight_flushes.append((chunk, mb, queue.flush()))
        if isinstance(self.stages[chunk], FSDPModule):  # into FSDP2's (fp32) accumulator
            fold_held_gradients(self.stages[chunk])

    def _specs(self, kind: int, stage: int, mb: int, step: _Step) -> list:
        """Shapes and dtypes of a message to `stage` (on this rank): hidden states and stats."""
        receiver = self.stages[stage_rank(stage, self.pp)[1]]
        assert receiver.stage == stage, f"{receiver.stage=}, {stage=}, rank {self.rank}"
        batch, seq = step.microbatches[mb].input_ids.shape
        experts = receiver.experts_before  # activations: the statistics of earlier stages
        if kind == GRADIENT:  # the gradient of this stage's outputs: with its own layers'
            experts = experts + receiver.experts_here
        return [((batch, seq, receiver.hidden_size), self.dtype),
                ((_stats_numel(experts, batch),), torch.float32)]  # fmt: skip

    def _post_receives(self, messages: Sequence[Message], step: _Step) -> None:
        """Posts the receives of `messages` (from other ranks, in the plan's order) as one
        batch, into buffers kept until the action that needs each one."""
        ops, spans = [], []
        for msg in messages:
            buffers = [torch.empty(shape, dtype=dtype, device=self.device)
                       for shape, dtype in self._specs(msg.kind, msg.stage, msg.micro_batch,
                                                       step)]  # fmt: skip
            parts = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=msg.sender)
                     for t in buffers if t.numel()]  # fmt: skip
            spans.append((msg, buffers, slice(len(ops), len(ops) + len(parts))))
            ops += parts
        works = dist.batch_isend_irecv(ops) if ops else []
        # gloo gives a work per operation: a message waits for its own. NCCL gives one for
        # the whole batch (it completes as one): every message waits for it.
        per_op = len(works) == len(ops)
        for msg, buffers, span in spans:
            step.incoming[msg.key] = (buffers, works[span] if per_op else works)

    def _hand_over(self, kind: int, stage: int, mb: int, tensors: list[Tensor],
                   step: _Step) -> None:  # fmt: skip
        """Gives `tensors` to `stage` (the receiver): locally, or sent to its rank (one
        batch, not waited for until the step ends)."""
        rank, _ = stage_rank(stage, self.pp)
        if rank == self.rank:
            step.local[(kind, stage, mb)] = tensors
            return
        # The receiver allocates [B, S, D] in the model's dtype and fp32 statistics: any
        # other dtype would be matched by byte count (NCCL) and read as garbage, or hang.
        hidden, stats = tensors
        assert hidden.dtype == self.dtype and hidden.dim() == 3 and stats.dtype == torch.float32, (
            f"rank {self.rank}: sending {hidden.dtype} {tuple(hidden.shape)} and {stats.dtype} "
            f"to stage {stage}, which receives {self.dtype} [B, S, D] and torch.float32"
        )
        tensors = [t.contiguous() for t in tensors if t.numel()]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=rank) for t in tensors]
        if ops:
            step.sends.append((dist.batch_isend_irecv(ops), tensors))  # tensors live till sent

    def _receive(self, kind: int, stage: int, mb: int, step: _Step) -> list[Tensor]:
        """What `stage` receives for `mb`: this rank's hand-over, or the posted receive."""
        local = step.local.pop((kind, stage, mb), None)
        if local is not None:
            return local
        posted = step.incoming.pop((kind, stage, mb), None)
        assert posted is not None, f"rank {self.rank}: {(kind, stage, mb)=} is not in the plan"
        buffers, works = posted
        for work in works:
            work.wait()  # NCCL: the current stream waits; gloo: this thread
        return buffers

    def _result(self, step: _Step) -> StepResult:
        """The step's StepResult from rank 0's losses, broadcast to every pipeline rank."""
        result = step.losses.result() if len(step.losses) else None
        if self.pp > 1:
            box = [result]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            result = box[0]
        assert result is not None, f"rank {self.rank}: no loss reached this rank"
        return result
