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
from mt_parallel.pipeline_sim import _check_action_types, _check_rank_order

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

    Raises:
        ValueError: `pp` is no integer >= 1, or `schedule` has another number of rank lists
            or an action that is not DualPipeV's; an action comes before work of its own
            rank that it needs (a B before its F, a W before its B); an action sends a
            message twice, takes one twice, or no action takes one sent; or the order
            deadlocks. The error names pp, the rank, the action's position and the message.
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"message_plan: pp ({pp!r}) must be an integer >= 1 (pipeline ranks)")
    try:  # passes over the actions, once per micro-batch count
        _check_action_types(schedule, pp)
        _check_rank_order(schedule, pp)
    except ValueError as err:
        raise ValueError(f"message_plan (pp={pp}): {err}") from None
    plan: list[list[list[Message]]] = [[] for _ in range(pp)]
    sent: set[tuple[int, int, int]] = set()  # keys, including hand-overs within a rank
    taken: set[tuple[int, int, int]] = set()  # keys of the messages actions have needed
    order: list[Message] = []  # messages between ranks, in the order they are sent
    posted = [0] * pp  # per rank, how much of `order` it has looked through
    while any(len(plan[r]) < len(actions) for r, actions in enumerate(schedule)):
        progress = False
        for r, actions in enumerate(schedule):
            i = len(plan[r])
            if i == len(actions):
                continue
            action = actions[i]
            needs = _needs(action, r, pp)
            if any(n.key not in sent for n in needs):
                continue
            for msg in needs:
                if msg.key in taken:
                    raise ValueError(f"message_plan (pp={pp}): rank {r} action {i} ({action}) "
                                     f"takes {_describe(msg)} a second time: {_ONCE}")  # fmt: skip
                taken.add(msg.key)
            plan[r].append([msg for msg in order[posted[r] :] if msg.receiver == r])
            posted[r] = len(order)
            for msg in _sends(action, r, pp):
                if msg.key in sent:
                    raise ValueError(f"message_plan (pp={pp}): rank {r} action {i} ({action}) "
                                     f"sends {_describe(msg)} a second time: {_ONCE}")  # fmt: skip
                sent.add(msg.key)
                if msg.sender != msg.receiver:
                    order.append(msg)
            progress = True
        if not progress:
            raise ValueError(
                f"message_plan (pp={pp}): the schedule deadlocks: "
                + "; ".join(_blocked(schedule, plan, sent, pp))
                + "; reorder the rank lists so that each action follows the ones it needs"
            )
    if sent != taken:  # each message sent and taken once: the plan posts it in time
        untaken = [_message(*key, pp) for key in sorted(sent - taken)]
        missing = [f"{_describe(m)} (rank {m.receiver}'s {_taker(m, pp)} is missing)"
                   for m in untaken]  # fmt: skip
        raise ValueError(f"message_plan (pp={pp}): no action takes {'; '.join(missing)}: {_ONCE}")
    return plan


_ONCE = "the schedule must run each stage's forward and backward once per micro-batch"


def _describe(m: Message) -> str:
    what = "input" if m.kind == ACTIVATION else "output gradient"
    return f"stage {m.stage}'s {what} of micro-batch {m.micro_batch} from rank {m.sender}"


def _taker(m: Message, pp: int) -> str:
    """The action that takes a message: its receiving stage's F, or its B (or BW)."""
    chunk = stage_rank(m.stage, pp)[1]
    return f"{'F' if m.kind == ACTIVATION else 'B'}{chunk}[{m.micro_batch}]"


def _blocked(
    schedule: Sequence[Sequence[Action]],
    plan: list[list[list[Message]]],
    sent: set[tuple[int, int, int]],
    pp: int,
) -> list[str]:
    """Each rank that has actions left: its next action and the messages it still waits for."""
    out = []
    for r, actions in enumerate(schedule):
        i = len(plan[r])
        if i < len(actions):
            waits = [_describe(m) for m in _needs(actions[i], r, pp) if m.key not in sent]
            out.append(f"rank {r} at action {i} ({actions[i]}) waits for " + ", ".join(waits))
    return out
