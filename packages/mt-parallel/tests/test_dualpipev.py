"""DualPipeV as data: complete, deadlock-free, and as short and lean as DeepSeek says.

Published numbers (deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory Usage
Comparison (based on the same number of PP stages)"; PP there is the number of stages,
so PP = 2·pp for our pp ranks): DualPipeV's bubble is (PP/2−1)(F&B+B−3W) and its
activation memory PP+1 micro-batches per device, with 2× the parameters of a 1F1B device
of the same stage count, on PP/2 devices. F is one chunk's forward, B one chunk's *full*
backward (input and weight gradients), W its weight part, F&B an overlapped pair. In our
terms: idle = (pp−1)(F&B + (backward + weight) − 3·weight), peak activations 2·pp+1.
"""

import itertools

import pytest

from mt_parallel.dualpipev import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    dualpipev_schedule,
    stage_of,
    stage_rank,
)
from mt_parallel.pipeline_sim import simulate

GRID = [(pp, m) for pp in range(1, 9) for m in sorted({2 * pp, 2 * pp + 1, 3 * pp + 2, 20})]


def _flat(action):
    """The plain actions inside one action (a ForwardBackward holds two)."""
    if isinstance(action, ForwardBackward):
        return [action.forward, action.backward]
    return [action]


def _parts(action, rank, pp):
    """(kind, stage, micro-batch) of each F, B and W the action runs."""
    kinds = {Forward: "F", BackwardInput: "B", BackwardWeight: "W", Backward: "BW"}
    for a in _flat(action):
        stage = rank if a.chunk == 0 else 2 * pp - 1 - rank  # the V
        yield from ((kind, stage, a.micro_batch) for kind in kinds[type(a)])


@pytest.mark.parametrize("pp,m", GRID)
def test_every_stage_runs_each_micro_batch_forward_backward_and_weight_once(pp, m):
    runs = {}  # (kind, stage, micro-batch) -> ranks that run it
    for rank, actions in enumerate(dualpipev_schedule(pp, m)):
        for action in actions:
            for part in _parts(action, rank, pp):
                runs.setdefault(part, []).append(rank)
    expected = {(k, s, mb) for k in "FBW" for s in range(2 * pp) for mb in range(m)}
    assert set(runs) == expected
    for (kind, stage, mb), ranks in runs.items():
        assert ranks == [min(stage, 2 * pp - 1 - stage)], (kind, stage, mb, ranks)


@pytest.mark.parametrize("pp,m", GRID)
def test_each_chunk_takes_micro_batches_in_order_and_weights_follow_their_backward(pp, m):
    for actions in dualpipev_schedule(pp, m):
        flat = list(itertools.chain.from_iterable(map(_flat, actions)))
        for chunk in (0, 1):
            forwards = [a.micro_batch for a in flat if isinstance(a, Forward) and a.chunk == chunk]
            backwards = [
                a.micro_batch
                for a in flat
                if isinstance(a, (Backward, BackwardInput)) and a.chunk == chunk
            ]
            assert forwards == list(range(m)) and backwards == list(range(m))
        for i, action in enumerate(flat):
            if isinstance(action, BackwardWeight):
                b = BackwardInput(action.chunk, action.micro_batch)
                assert b in flat[:i], (action, flat)


@pytest.mark.parametrize("pp,m", GRID)
def test_bubble_is_deepseeks_when_forward_backward_and_weight_take_equal_time(pp, m):
    """With F = B = W = t per chunk the README's formula holds exactly: on the last rank
    (the V's bottom), which idles most, for any F&B between full overlap (max: 2t) and
    none (sum: 3t, the default and DeepSeek's figure, where every rank idles the same)."""
    for t, pair in [(1.0, None), (1.0, 2.0), (0.5, 1.25), (3.0, 7.5), (1.0, 3.0)]:
        sim = simulate(
            dualpipev_schedule(pp, m), pp, forward=t, backward=t, weight=t, overlapped=pair
        )
        f_and_b = 3 * t if pair is None else pair
        bubble = (pp - 1) * (f_and_b + 2 * t - 3 * t)
        assert sim.idle[-1] == pytest.approx(bubble) and max(sim.idle) == pytest.approx(bubble)
        if pair is None:  # every rank does the same 6m units of work
            assert sim.idle == pytest.approx([bubble] * pp)
            assert sim.makespan == pytest.approx(6 * m * t + bubble)
            assert sim.bubble_fraction == pytest.approx(bubble / (6 * m * t + bubble))


@pytest.mark.parametrize("pp,m", GRID)
def test_simulated_ranks_run_one_action_at_a_time_after_the_data_they_need(pp, m):
    costs = {"forward": 1.0, "backward": 1.7, "weight": 0.6, "overlapped": 2.9, "transfer": 0.3}
    sim = simulate(dualpipev_schedule(pp, m), pp, **costs)
    done = {}  # (kind, stage, micro-batch) -> (rank, end time)
    for rank, timeline in enumerate(sim.timelines):
        assert timeline[0].start >= 0
        assert all(b.start >= a.end for a, b in itertools.pairwise(timeline))
        done.update((p, (rank, s.end)) for s in timeline for p in _parts(s.action, rank, pp))
    for rank, timeline in enumerate(sim.timelines):
        for slot in timeline:
            for kind, stage, mb in _parts(slot.action, rank, pp):
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind == "B":
                    needs = [("F", stage, mb)] + [("B", stage + 1, mb)] * (stage < 2 * pp - 1)
                else:  # W: after its B, at the latest together with it (a full backward)
                    assert done["B", stage, mb][1] <= slot.end
                    continue
                for need in needs:
                    source, end = done[need]
                    delay = costs["transfer"] if source != rank else 0.0
                    assert slot.start >= end + delay - 1e-9, (rank, slot, need)
    assert sim.makespan == max(timeline[-1].end for timeline in sim.timelines)


@pytest.mark.parametrize("pp,m", GRID)
def test_peak_activations_are_deepseeks_pp_plus_one_per_device(pp, m):
    """2·pp+1 per rank (README: PP+1, PP = 2·pp stages). Per chunk, derived from the steps:
    chunk 0 of rank r runs 2(pp−r−1) + (r+1) forwards before any backward (steps 1, 2), and
    one more in step 4's first pair before its first B0; chunk 1 runs r+1 in step 2, and
    each later F1 follows a B1 (steps 3, 4, 5)."""
    sim = simulate(dualpipev_schedule(pp, m), pp)
    assert sim.peak_activations == [(2 * pp - r, r + 1) for r in range(pp)]
    assert sim.peak_activations_total == [2 * pp + 1] * pp


def test_two_ranks_four_micro_batches_run_as_drawn_by_hand():
    """pp = 2, m = 4, F = B = W = 1, a pair costs 3. Stages 0 and 3 on rank 0, 1 and 2 on
    rank 1. Start times; `..` is idle, `&` an overlapped pair, BW a full backward:

    rank 0: 0 F0[0] 1 F0[1] 2 F0[2] 3 F1[0] 4 B1[0] 5 W1[0] 6 F1[1] 7 F0[3]&BW1[1] 10 ..
            11 F1[2]&BW0[0] 14 BW1[2] 16 .. 17 F1[3]&BW0[1] 20 BW1[3] 22 B0[2] 23 W0[2]
            24 B0[3] 25 W0[3] 26
    rank 1: 0 .. 1 F0[0] 2 F1[0] 3 F0[1] 4 F1[1] 5 F0[2] 6 BW1[0] 8 F1[2]&BW0[0]
            11 F0[3]&BW1[1] 14 F1[3]&BW0[1] 17 BW1[2] 19 BW0[2] 21 .. 22 B1[3] 23 B0[3]
            24 W1[3] 25 W0[3] 26

    E.g. rank 0 idles at 10: F1[2] (stage 3) needs stage 2's F[2], and BW0[0] (stage 0)
    stage 1's B[0], both in rank 1's pair 8-11. Each rank idles 2 = (pp−1)(3+2−3).
    """
    sim = simulate(dualpipev_schedule(2, 4), 2)
    drawn = [
        "0 F0[0] 1 F0[1] 2 F0[2] 3 F1[0] 4 B1[0] 5 W1[0] 6 F1[1] 7 F0[3]&BW1[1] "
        "11 F1[2]&BW0[0] 14 BW1[2] 17 F1[3]&BW0[1] 20 BW1[3] 22 B0[2] 23 W0[2] 24 B0[3] "
        "25 W0[3]",
        "1 F0[0] 2 F1[0] 3 F0[1] 4 F1[1] 5 F0[2] 6 BW1[0] 8 F1[2]&BW0[0] 11 F0[3]&BW1[1] "
        "14 F1[3]&BW0[1] 17 BW1[2] 19 BW0[2] 22 B1[3] 23 B0[3] 24 W1[3] 25 W0[3]",
    ]
    got = [" ".join(f"{slot.start:g} {slot.action}" for slot in tl) for tl in sim.timelines]
    assert got == drawn
    assert sim.makespan == 26 and sim.idle == [2, 2]


def test_one_rank_v_runs_without_idling_or_transfers():
    """pp = 1 folds the V onto one rank: stages 0 and 1 there, nothing to wait for."""
    sim = simulate(dualpipev_schedule(1, 5), 1, transfer=10.0)
    assert sim.makespan == 6 * 5 and sim.idle == [0]


def test_transfer_time_is_charged_only_between_ranks():
    schedule = dualpipev_schedule(2, 4)
    base = simulate(schedule, 2).timelines
    late = simulate(schedule, 2, transfer=0.5).timelines
    # Rank 1's first F0 waits for rank 0's activation; its F1 right after takes the V's
    # bottom hand-over from its own F0 with no transfer.
    assert late[1][0].start == base[1][0].start + 0.5
    assert late[1][1].start == late[1][0].end


def test_missing_action_is_named():
    schedule = dualpipev_schedule(2, 4)
    del schedule[1][5]  # rank 1's BW1[0]: stage 2's B and W of micro-batch 0
    with pytest.raises(ValueError, match=r"B1\[0\] of rank 1 \(stage 2\): missing.*W1\[0\]"):
        simulate(schedule, 2)


def test_duplicated_action_is_named():
    schedule = dualpipev_schedule(2, 4)
    schedule[0].append(Forward(1, 2))
    with pytest.raises(ValueError, match=r"F1\[2\] of rank 0 \(stage 3\): run 2 times"):
        simulate(schedule, 2)


def test_swap_within_a_rank_deadlocks_it_and_the_rank_waiting_on_it():
    schedule = dualpipev_schedule(2, 4)
    schedule[1][0], schedule[1][1] = schedule[1][1], schedule[1][0]  # F1[0] before F0[0]
    with pytest.raises(ValueError) as err:
        simulate(schedule, 2)
    message = str(err.value)
    assert "rank 1 at action 0 (F1[0]) waits for F0[0] of rank 1 (stage 1)" in message
    assert "rank 0 at action 3 (F1[0]) waits for F1[0] of rank 1 (stage 2)" in message


def test_swap_across_ranks_deadlock_names_every_blocked_rank():
    schedule = dualpipev_schedule(2, 4)
    schedule[0][0], schedule[0][3] = schedule[0][3], schedule[0][0]  # F1[0] first on rank 0
    with pytest.raises(ValueError) as err:
        simulate(schedule, 2)
    message = str(err.value)
    assert "rank 0 at action 0 (F1[0]) waits for F1[0] of rank 1 (stage 2)" in message
    assert "rank 1 at action 0 (F0[0]) waits for F0[0] of rank 0 (stage 0)" in message


def test_backward_before_its_forward_deadlocks():
    schedule = dualpipev_schedule(1, 2)
    first_backward = next(i for i, a in enumerate(schedule[0]) if not isinstance(a, Forward))
    schedule[0].insert(0, schedule[0].pop(first_backward))
    with pytest.raises(ValueError, match=r"deadlocks: rank 0 at action 0 .* waits for F"):
        simulate(schedule, 1)


@pytest.mark.parametrize(
    "pp,m,message",
    [
        (0, 4, r"pp \(0\) must be an integer >= 1"),
        (2.0, 4, r"pp \(2.0\) must be an integer >= 1"),
        (4, 7, r"num_micro_batches \(7\) must be >= 2\*pp \(8\).*or pp <= 3"),
        (1, 1, r"num_micro_batches \(1\) must be >= 2\*pp \(2\).*global batch\)$"),
        (2, "8", r"num_micro_batches \('8'\) must be an integer"),
    ],
)
def test_bad_sizes_are_refused_with_the_fix(pp, m, message):
    with pytest.raises(ValueError, match=message):
        dualpipev_schedule(pp, m)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"forward": 0.0}, r"forward \(0.0\) must be a finite time > 0"),
        ({"weight": float("nan")}, r"weight \(nan\) must be a finite time > 0"),
        ({"overlapped": -1.0}, r"overlapped \(-1.0\) must be a finite time > 0, or None"),
        ({"transfer": -0.5}, r"transfer \(-0.5\) must be a finite time >= 0"),
    ],
)
def test_bad_costs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(dualpipev_schedule(2, 4), 2, **kwargs)


def test_schedule_for_another_pp_is_refused():
    with pytest.raises(ValueError, match=r"3 rank lists; pp \(2\) needs 2"):
        simulate(dualpipev_schedule(3, 6), 2)


@pytest.mark.parametrize(
    "action,message",
    [
        ("F0[0]", r"rank 0 action 0 \('F0\[0\]'\) is not a DualPipeV action"),
        (
            ForwardBackward(Forward(0, 0), BackwardInput(1, 0)),
            r"rank 0 action 0 .* must pair a Forward with a Backward",
        ),
        (Forward(2, 0), r"rank 0 action 0 \(F2\[0\]\): chunk must be 0 or 1"),
    ],
)
def test_foreign_actions_are_refused(action, message):
    schedule = dualpipev_schedule(2, 4)
    schedule[0][0] = action
    with pytest.raises(ValueError, match=message):
        simulate(schedule, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: stage_of(2, 0, 2), r"^stage_of: rank \(2\) must be in \[0, pp=2\) and chunk "
                                    r"\(0\) 0 or 1"),
        (lambda: stage_of(0, 2, 2), r"^stage_of: rank \(0\) must be in \[0, pp=2\) and chunk "
                                    r"\(2\) 0 or 1"),
        (lambda: stage_of(-1, 1, 2), r"^stage_of: rank \(-1\) must be in \[0, pp=2\)"),
        (lambda: stage_rank(4, 2), r"^stage_rank: stage \(4\) must be in \[0, 2\*pp=4\)"),
        (lambda: stage_rank(-1, 1), r"^stage_rank: stage \(-1\) must be in \[0, 2\*pp=2\)"),
    ],
)  # fmt: skip
def test_stage_of_and_stage_rank_refuse_what_no_rank_holds_with_a_value_error(call, message):
    # Asserts before: gone under python -O, where stage_of(2, 0, 2) returned stage 2 (rank
    # 1's chunk 1) and stage_rank(4, 2) rank -1.
    with pytest.raises(ValueError, match=message):
        call()
