"""DualPipeV as data: the per-rank action lists of DeepSeek's schedule.

DualPipeV (deepseek-ai/DualPipe, ``dualpipe/dualpipev.py``; the "cut-in-half" DualPipe of
the DeepSeek-V3 report, arXiv:2412.19437 §3.2.1) lays 2·pp stages out as a V over pp ranks:
rank r holds stage r (chunk 0, the V's descending arm) and stage 2·pp−1−r (chunk 1, the
ascending arm). Rank 0 thus holds both the first stage (embedding) and the last (loss), and
rank pp−1 holds the V's bottom, stages pp−1 and pp, whose hand-over needs no transfer.

:func:`dualpipev_schedule` writes each rank's work as a list of typed actions following
DeepSeek's eight steps; nothing here runs a model. ``mt_parallel.pipeline.
DualPipeVExecutor`` runs the lists: a :class:`ForwardBackward` interleaves one
micro-batch's forward with another's backward so that each hides the other's
communication (the executor still runs the two one after the other), and a
:class:`BackwardInput` leaves its weight gradient to a later :class:`BackwardWeight`
(mt_ops.WeightGradQueue), which fills what would otherwise be pipeline bubbles.
Communication is not an action: a stage's forward output goes to stage s+1 and its input
gradient to stage s−1, so the sends and receives follow from stage adjacency
(:func:`stage_rank`).

:func:`mt_parallel.pipeline_sim.simulate` runs the lists in order against the cross-stage
dependencies, refuses a schedule that misses, repeats or deadlocks on an action, and
measures makespan, bubble and the activations each rank holds, so the schedule is
unit-tested on CPU.

Notation (DeepSeek's): F forward, B backward for inputs, W backward for weights; a digit is
the chunk, ``F1[3]`` the forward of chunk 1 on micro-batch 3.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = [
    "Action",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "ForwardBackward",
    "dualpipev_schedule",
    "stage_of",
    "stage_rank",
]


@dataclass(frozen=True)
class Forward:
    """F: the forward of one chunk (0 or 1) of the rank on one micro-batch."""

    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"F{self.chunk}[{self.micro_batch}]"


@dataclass(frozen=True)
class BackwardInput:
    """B: the input gradient only; the weight gradient waits for a :class:`BackwardWeight`."""

    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"B{self.chunk}[{self.micro_batch}]"


@dataclass(frozen=True)
class BackwardWeight:
    """W: the deferred weight gradient of an earlier :class:`BackwardInput`."""

    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"W{self.chunk}[{self.micro_batch}]"


@dataclass(frozen=True)
class Backward:
    """B and W together: a full backward, where DeepSeek does not split it."""

    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"BW{self.chunk}[{self.micro_batch}]"


@dataclass(frozen=True)
class ForwardBackward:
    """A forward and the full backward of another micro-batch, interleaved by the executor
    (DeepSeek's ``_forward_backward_chunk``: each one's communication hides behind the
    other's computation)."""

    forward: Forward
    backward: Backward

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"


Action = Forward | BackwardInput | BackwardWeight | Backward | ForwardBackward


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """The pipeline stage of a rank's chunk: r on the descending arm, 2·pp−1−r ascending."""
    if chunk not in (0, 1) or not 0 <= rank < pp:
        raise ValueError(
            f"stage_of: rank ({rank}) must be in [0, pp={pp}) and chunk ({chunk}) 0 or 1 (the "
            "V's descending or ascending arm)"
        )
    return rank if chunk == 0 else 2 * pp - 1 - rank


def stage_rank(stage: int, pp: int) -> tuple[int, int]:
    """The (rank, chunk) that holds a stage, the inverse of :func:`stage_of`."""
    if not 0 <= stage < 2 * pp:
        raise ValueError(f"stage_rank: stage ({stage}) must be in [0, 2*pp={2 * pp}) (pp={pp})")
    return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)


def check_dualpipev_sizes(pp: int, num_micro_batches: int) -> None:
    """Raises ValueError unless DualPipeV can schedule `num_micro_batches` over `pp` ranks.

    Args:
        pp: pipeline ranks (the V has 2·pp stages). pp == 1 is the V folded onto one rank:
            two stages, no communication, the same action types (an executor's
            one-process test).
        num_micro_batches: micro-batches per step; DeepSeek's schedule needs at least
            2·pp (its warm-up alone runs 2·pp−1 forwards of chunk 0 on rank 0).
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp ({pp!r}) must be an integer >= 1 (the number of pipeline ranks)")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
        raise ValueError(f"num_micro_batches ({num_micro_batches!r}) must be an integer")
    if num_micro_batches < 2 * pp:
        fewer = f", or pp <= {num_micro_batches // 2}" if num_micro_batches >= 2 else ""
        raise ValueError(
            f"num_micro_batches ({num_micro_batches}) must be >= 2*pp ({2 * pp}): DualPipeV "
            f"fills its V with 2*pp micro-batches before the steady state; use at least "
            f"{2 * pp} micro-batches per step (a smaller micro-batch or a larger global "
            f"batch){fewer}"
        )


class _RankBuilder:
    """Appends one rank's actions, numbering micro-batches per chunk in order and keeping
    the deferred weight gradients first-in first-out, as DeepSeek's WeightGradStore does."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next_forward = [0, 0]
        self._next_backward = [0, 0]
        self._deferred: deque[BackwardInput] = deque()

    def _forward(self, chunk: int) -> Forward:
        self._next_forward[chunk] += 1
        return Forward(chunk, self._next_forward[chunk] - 1)

    def _backward(self, chunk: int) -> int:
        self._next_backward[chunk] += 1
        return self._next_backward[chunk] - 1

    def forward(self, chunk: int) -> None:
        self.actions.append(self._forward(chunk))

    def backward(self, chunk: int, *, defer_weight: bool) -> None:
        micro_batch = self._backward(chunk)
        if defer_weight:
            self._deferred.append(BackwardInput(chunk, micro_batch))
            self.actions.append(self._deferred[-1])
        else:
            self.actions.append(Backward(chunk, micro_batch))

    def weight(self) -> None:
        oldest = self._deferred.popleft()
        self.actions.append(BackwardWeight(oldest.chunk, oldest.micro_batch))

    def forward_backward(self, forward_chunk: int, backward_chunk: int) -> None:
        forward = self._forward(forward_chunk)
        backward = Backward(backward_chunk, self._backward(backward_chunk))
        self.actions.append(ForwardBackward(forward, backward))


def dualpipev_schedule(pp: int, num_micro_batches: int) -> list[list[Action]]:
    """Each rank's DualPipeV actions for one step, in the order the rank runs them.

    The eight steps of deepseek-ai/DualPipe ``DualPipeV.step`` (rank r of pp, m
    micro-batches; each chunk's forwards and backwards take micro-batches in order):

    1. nF0: 2·(pp−r−1) warm-up forwards of chunk 0;
    2. nF0F1: r+1 times F0, F1;
    3. nB1W1F1: pp−r−1 times B1, its W1 at once, F1;
    4. nF0B1F1B0 (main): m−2·pp+r+1 times the pairs F0&B1, F1&B0 (on rank pp−1 the first
       F0 and B1 run one after the other: its F0 feeds its own F1, so waiting on the B1
       would only delay it);
    5. nB1F1B0: pp−r−1 times B1, F1&B0;
    6. nB1B0: r+1 times B1, B0, the second half with deferred weight gradients;
    7. nWB0: pp−r−1 times W (the oldest deferred), B0 with its W deferred;
    8. nW: the r+1 weight gradients left.

    Args:
        pp: pipeline ranks (>= 1; 1 puts both stages of the V on one rank).
        num_micro_batches: micro-batches per step, >= 2·pp.

    Returns:
        One list of actions per rank. Every stage runs each micro-batch's F once and its
        B and W once each, as a :class:`Backward` or a :class:`BackwardInput` and a later
        :class:`BackwardWeight`.
    """
    check_dualpipev_sizes(pp, num_micro_batches)
    m = num_micro_batches
    schedule = []
    for r in range(pp):
        rank = _RankBuilder()
        # Step 1: nF0
        for _ in range(2 * (pp - r - 1)):
            rank.forward(0)
        # Step 2: nF0F1
        for _ in range(r + 1):
            rank.forward(0)
            rank.forward(1)
        # Step 3: nB1W1F1 (zero bubble: the weight gradient right after its backward)
        for _ in range(pp - r - 1):
            rank.backward(1, defer_weight=True)
            rank.weight()
            rank.forward(1)
        # Step 4 (main): nF0B1F1B0
        for i in range(m - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:
                rank.forward(0)
                rank.backward(1, defer_weight=False)
            else:
                rank.forward_backward(0, 1)
            rank.forward_backward(1, 0)
        # Step 5: nB1F1B0
        for _ in range(pp - r - 1):
            rank.backward(1, defer_weight=False)
            rank.forward_backward(1, 0)
        # Step 6: nB1B0 (from the middle on, weight gradients deferred; on even ranks the
        # middle B1 keeps its own, so each rank defers r+1 of them)
        half = (r + 1) // 2
        for i in range(r + 1):
            rank.backward(1, defer_weight=i > half or (i == half and r % 2 == 1))
            rank.backward(0, defer_weight=i >= half)
        # Step 7: nWB0
        for _ in range(pp - r - 1):
            rank.weight()
            rank.backward(0, defer_weight=True)
        # Step 8: nW
        for _ in range(r + 1):
            rank.weight()
        assert not rank._deferred, f"{r=}, {pp=}, {m=}, {rank._deferred=}"
        schedule.append(rank.actions)
    return schedule
