"""The order of DualPipeV's point-to-point messages, fixed so that they match without tags.

NCCL has no tags: between two ranks, the k-th send from one matches the k-th receive the
other posts from it. :func:`message_plan` therefore orders every message of a step once,
the same way on every rank (it depends only on the ranks' action lists), and tells
each rank which messages to post receives for before each of its actions. Why that order
cannot deadlock is in :mod:`mt_parallel.pipeline`'s docstring, which runs the plan.

The global order is a run of the schedule in one process: ranks take turns, each running
its next action if every message the action needs has been sent; an action's messages are
sent when it runs, in the order the executor hands them over (a ``ForwardBackward``'s
forward output before its backward's input gradient). Before an action, its rank posts
receives for every message to it sent earlier in that run and not posted yet: those the
action needs and any sent before them (received ahead, into buffers kept for a later
action). Each rank's sends and receives thus follow the global order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mt_parallel.dualpipev import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    stage_of,
    stage_rank,
)

__all__ = ["ACTIVATION", "GRADIENT", "Message", "message_plan"]

ACTIVATION, GRADIENT = 0, 1


@dataclass(frozen=True)
class Message:
    """A stage's forward output (``ACTIVATION``, to stage+1) or input gradient (``GRADIENT``,
    to stage−1) for one micro-batch: the hidden states and the router statistics.

    Attributes:
        kind: ``ACTIVATION`` or ``GRADIENT``.
        stage: the receiving stage.
        micro_batch: the micro-batch.
        sender: the rank of the sending stage.
        receiver: the rank of the receiving stage.
    """

    kind: int
    stage: int
    micro_batch: int
    sender: int
    receiver: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.kind, self.stage, self.micro_batch)


def _parts(action: Action) -> list[Action]:
    """The forward and backward parts of an action, in the order the executor runs them."""
    if isinstance(action, ForwardBackward):
        return [action.forward, action.backward]
    return [action]


def _message(kind: int, stage: int, mb: int, pp: int) -> Message:
    source = stage - 1 if kind == ACTIVATION else stage + 1
    return Message(kind, stage, mb, stage_rank(source, pp)[0], stage_rank(stage, pp)[0])


def _needs(action: Action, rank: int, pp: int) -> list[Message]:
    """The messages an action receives (from another rank or from its own rank)."""
    out = []
    for part in _parts(action):
        stage = stage_of(rank, part.chunk, pp)
        if isinstance(part, Forward) and stage > 0:
            out.append(_message(ACTIVATION, stage, part.micro_batch, pp))
        elif isinstance(part, (BackwardInput, Backward)) and stage < 2 * pp - 1:
            out.append(_message(GRADIENT, stage, part.micro_batch, pp))
    return out


def _sends(action: Action, rank: int, pp: int) -> list[Message]:
    """The messages an action hands over, in order."""
    out = []
    for part in _parts(action):
        stage = stage_of(rank, part.chunk, pp)
        if isinstance(part, Forward) and stage < 2 * pp - 1:
            out.append(_message(ACTIVATION, stage + 1, part.micro_batch, pp))
        elif isinstance(part, (BackwardInput, Backward)) and stage > 0:
            out.append(_message(GRADIENT, stage - 1, part.micro_batch, pp))
        else:
            assert isinstance(part, (Forward, BackwardInput, Backward, BackwardWeight)), part
    return out


def message_plan(schedule: Sequence[Sequence[Action]], pp: int) -> list[list[list[Message]]]:
    """Per rank, per action of `schedule[rank]`: the messages from other ranks whose
    receives the rank posts before that action, in order.

    Args:
        schedule: every rank's actions, ``dualpipev_schedule(pp, num_micro_batches)``.
        pp: pipeline ranks.

    Returns:
        ``plan[rank][i]``: the receives to post before action i. Every message between two
        ranks appears once, at or before the action that needs it, and for each pair of
        ranks in the order the sender sends them.
    """
    plan: list[list[list[Message]]] = [[] for _ in range(pp)]
    sent: set[tuple[int, int, int]] = set()  # keys, including hand-overs within a rank
    order: list[Message] = []  # messages between ranks, in the order they are sent
    posted = [0] * pp  # per rank, how much of `order` it has looked through
    while any(len(plan[r]) < len(actions) for r, actions in enumerate(schedule)):
        progress = False
        for r, actions in enumerate(schedule):
            if len(plan[r]) == len(actions):
                continue
            action = actions[len(plan[r])]
            if any(n.key not in sent for n in _needs(action, r, pp)):
                continue
            plan[r].append([msg for msg in order[posted[r] :] if msg.receiver == r])
            posted[r] = len(order)
            for msg in _sends(action, r, pp):
                sent.add(msg.key)
                if msg.sender != msg.receiver:
                    order.append(msg)
            progress = True
        assert progress, f"{pp=}: the schedule deadlocks after {[len(p) for p in plan]=}"
    received = sorted(m.key for rank_plan in plan for before in rank_plan for m in before)
    assert received == sorted(m.key for m in order), f"{pp=}: {received=}, {order=}"
    return plan
