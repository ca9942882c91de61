"""A simulator for pipeline schedules written as data (mt_parallel.dualpipev).

:func:`simulate` runs each rank's list of actions in order, every action as soon as the
data it needs exists, in a time model of one forward, backward-for-inputs and
backward-for-weights cost per chunk. It refuses a schedule that misses or repeats an
action, or deadlocks, naming the ranks and actions involved, and returns per-rank
timelines, makespan, idle time and the activations each rank holds: the schedule is
checked and measured on CPU before an executor runs it.
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

__all__ = ["Simulation", "Slot", "simulate"]


# A unit of work inside an action: ("F" | "B" | "W", stage, micro_batch); a Backward is
# one "B" and one "W".
_Work = tuple[str, int, int]


def _works(action: Action, rank: int, pp: int) -> list[_Work]:
    """The F, B and W an action performs, in the stages they belong to."""
    if isinstance(action, ForwardBackward):
        return _works(action.forward, rank, pp) + _works(action.backward, rank, pp)
    stage = stage_of(rank, action.chunk, pp)
    kinds = {Forward: "F", BackwardInput: "B", BackwardWeight: "W", Backward: "BW"}
    return [(kind, stage, action.micro_batch) for kind in kinds[type(action)]]  # "BW": 2


def _needs(work: _Work, pp: int) -> list[_Work]:
    """The work that must finish before `work` starts (DeepSeek's data flow)."""
    kind, stage, mb = work
    if kind == "F":  # the previous stage's output
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "B":  # its own forward, and the next stage's input gradient (the last
        # stage starts from its loss)
        return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < 2 * pp - 1 else [])
    return [("B", stage, mb)]  # W: the output gradient its B received


def _describe(work: _Work, pp: int) -> str:
    kind, stage, mb = work
    rank, chunk = stage_rank(stage, pp)
    return f"{kind}{chunk}[{mb}] of rank {rank} (stage {stage})"


@dataclass(frozen=True)
class Slot:
    """One action of a rank's timeline, from `start` to `end` in the simulator's time unit."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` measured.

    Attributes:
        timelines: per rank, its actions with start and end times, in schedule order.
        makespan: when the last action ends (all ranks start at 0).
        idle: per rank, makespan minus its busy time (DeepSeek's "bubble" per device).
        bubble_fraction: sum(idle) / (pp · makespan).
        peak_activations: per rank, per chunk, the most micro-batches whose activations the
            chunk holds at once: from the start of their F to the end of their B (the input
            gradient; a deferred W still needs the saved inputs of its linear layers, which
            this count leaves out).
        peak_activations_total: per rank, the most held by both chunks together.
    """

    timelines: list[list[Slot]]
    makespan: float
    idle: list[float]
    bubble_fraction: float
    peak_activations: list[tuple[int, int]]
    peak_activations_total: list[int]


def _check_action_types(schedule: Sequence[Sequence[Action]], pp: int) -> None:
    """Raises ValueError unless `schedule` holds pp rank lists of DualPipeV actions (chunk 0
    or 1, micro_batch >= 0), naming the first that is not."""
    if len(schedule) != pp:
        raise ValueError(f"the schedule has {len(schedule)} rank lists; pp ({pp}) needs {pp}")
    for r, actions in enumerate(schedule):
        for i, action in enumerate(actions):
            if isinstance(action, ForwardBackward):
                parts = [action.forward, action.backward]
                if not (isinstance(parts[0], Forward) and isinstance(parts[1], Backward)):
                    raise ValueError(
                        f"rank {r} action {i} ({action!r}) must pair a Forward with a Backward"
                    )
            elif isinstance(action, (Forward, BackwardInput, BackwardWeight, Backward)):
                parts = [action]
            else:
                raise ValueError(f"rank {r} action {i} ({action!r}) is not a DualPipeV action")
            for part in parts:
                if part.chunk not in (0, 1) or part.micro_batch < 0:
                    raise ValueError(
                        f"rank {r} action {i} ({action}): chunk must be 0 or 1 and micro_batch >= 0"
                    )


def _check_rank_order(schedule: Sequence[Sequence[Action]], pp: int) -> None:
    """Raises ValueError when an action comes before work of its own rank that it needs (a
    stage's B before its F, a W before its B, the V's bottom: stage pp's F before stage
    pp−1's). Messages between ranks order the rest; these need none, so nothing else
    would catch them before the executor does, with a less clear error. Work missing from
    the rank altogether is left to the checks that name it missing."""
    for r, actions in enumerate(schedule):
        planned = {work for action in actions for work in _works(action, r, pp)}
        done: set[_Work] = set()
        for i, action in enumerate(actions):
            for work in _works(action, r, pp):
                for need in _needs(work, pp):
                    if need in planned and need not in done:
                        raise ValueError(
                            f"rank {r} action {i} ({action}) runs {_describe(work, pp)} before "
                            f"{_describe(need, pp)}, which it needs; move it after that one"
                        )
                done.add(work)


def _check_actions(schedule: Sequence[Sequence[Action]], pp: int) -> None:
    """Raises ValueError for a foreign action, a missing one, or one run twice."""
    _check_action_types(schedule, pp)
    seen: dict[_Work, list[str]] = {}
    for r, actions in enumerate(schedule):
        for i, action in enumerate(actions):
            for work in _works(action, r, pp):
                seen.setdefault(work, []).append(f"rank {r} action {i}")
    num_micro_batches = 1 + max((mb for _, _, mb in seen), default=-1)
    problems = []
    for stage in range(2 * pp):
        for mb in range(num_micro_batches):
            for kind in "FBW":
                where = seen.get((kind, stage, mb), [])
                if len(where) != 1:
                    what = (
                        "missing" if not where else f"run {len(where)} times ({', '.join(where)})"
                    )
                    problems.append(f"{_describe((kind, stage, mb), pp)}: {what}")
    if problems:
        raise ValueError(
            f"the schedule must run each of the {2 * pp} stages' F, B and W once per "
            f"micro-batch (0..{num_micro_batches - 1}): " + "; ".join(problems)
        )


def _peak_activations(actions: Sequence[Action]) -> tuple[tuple[int, int], int]:
    """Per chunk and in total, the most micro-batches between F start and B end at once."""
    held, peak, peak_total = [0, 0], [0, 0], 0

    def start(chunk: int) -> None:
        nonlocal peak_total
        held[chunk] += 1
        peak[chunk] = max(peak[chunk], held[chunk])
        peak_total = max(peak_total, sum(held))

    for action in actions:
        if isinstance(action, Forward):
            start(action.chunk)
        elif isinstance(action, (BackwardInput, Backward)):
            held[action.chunk] -= 1
        elif isinstance(action, ForwardBackward):  # both micro-batches held while they run
            start(action.forward.chunk)
            held[action.backward.chunk] -= 1
    return (peak[0], peak[1]), peak_total


def simulate(
    schedule: Sequence[Sequence[Action]],
    pp: int,
    *,
    forward: float = 1.0,
    backward: float = 1.0,
    weight: float = 1.0,
    overlapped: float | None = None,
    transfer: float = 0.0,
) -> Simulation:
    """Runs each rank's actions in order, each as soon as its inputs exist, and times them.

    An F of stage s needs the F of stage s−1 on the same micro-batch; a B needs its own F and
    the B of stage s+1 (the last stage's B starts from its loss); a W needs its B. A rank
    runs one action at a time. A :class:`ForwardBackward` costs `overlapped`, by default
    forward + backward + weight: the pair of the DeepSeek-V3 report (Figure 4) interleaves
    the two chunks' computations so that each hides the other's communication (expert
    all-to-alls, pipeline transfers), which this model leaves out anyway; the computations
    themselves still run one after the other. Pass a measured F&B time (at least
    max(forward, backward + weight)) to credit the pair with more.

    Args:
        schedule: one action list per rank, e.g. from :func:`dualpipev_schedule`.
        pp: pipeline ranks.
        forward: time of one chunk's F.
        backward: time of one chunk's B (input gradient only).
        weight: time of one chunk's W.
        overlapped: time of a ForwardBackward; None for forward + backward + weight.
        transfer: time for an activation or gradient to reach another rank (0 between
            stages pp−1 and pp, which share rank pp−1).

    Returns:
        The timelines, makespan, idle time per rank, bubble fraction and peak activations.

    Raises:
        ValueError: the schedule misses an action, runs one twice, or deadlocks (the
            message names every blocked rank, its action and what that action waits for).
    """
    for name, value in (("forward", forward), ("backward", backward), ("weight", weight)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} ({value}) must be a finite time > 0")
    if overlapped is not None and not 0 < overlapped < float("inf"):
        raise ValueError(f"overlapped ({overlapped}) must be a finite time > 0, or None")
    if not 0 <= transfer < float("inf"):
        raise ValueError(f"transfer ({transfer}) must be a finite time >= 0")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp ({pp!r}) must be an integer >= 1")
    _check_actions(schedule, pp)
    pair = forward + backward + weight if overlapped is None else overlapped
    cost = {
        Forward: forward,
        BackwardInput: backward,
        BackwardWeight: weight,
        Backward: backward + weight,
        ForwardBackward: pair,
    }

    finished: dict[_Work, float] = {}
    timelines: list[list[Slot]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(schedule):
            while len(timelines[r]) < len(actions):
                action = actions[len(timelines[r])]
                works = _works(action, r, pp)
                needs = {n for work in works for n in _needs(work, pp)} - set(works)
                if any(n not in finished for n in needs):
                    break
                start = max(
                    [clock[r]]
                    + [
                        finished[n] + (transfer if stage_rank(n[1], pp)[0] != r else 0.0)
                        for n in needs
                    ]
                )
                clock[r] = start + cost[type(action)]
                finished.update((work, clock[r]) for work in works)
                timelines[r].append(Slot(action, start, clock[r]))
                progress = True
    blocked = []
    for r, actions in enumerate(schedule):
        if len(timelines[r]) < len(actions):
            i = len(timelines[r])
            works = _works(actions[i], r, pp)
            waits = sorted({n for w in works for n in _needs(w, pp)} - set(works) - set(finished))
            blocked.append(
                f"rank {r} at action {i} ({actions[i]}) waits for "
                + ", ".join(_describe(n, pp) for n in waits)
            )
    if blocked:
        raise ValueError("the schedule deadlocks: " + "; ".join(blocked))

    makespan = max(clock)
    idle = [makespan - sum(s.end - s.start for s in timeline) for timeline in timelines]
    peaks = [_peak_activations(actions) for actions in schedule]
    return Simulation(
        timelines=timelines,
        makespan=makespan,
        idle=idle,
        bubble_fraction=sum(idle) / (pp * makespan),
        peak_activations=[p for p, _ in peaks],
        peak_activations_total=[t for _, t in peaks],
    )
