"""The message plan of the DualPipeV executor matches sends and receives without tags and
cannot deadlock when a send waits for its receive, for every pp and micro-batch count.

The check replays each rank's operations as the executor issues them (before each action
one batch of the plan's receives, then one send per message the action hands over) under
NCCL's strictest reading: a rank's batches run one after another, a batch ends when all
its operations have, a send ends only with its receive, and between two ranks the k-th
send matches the k-th receive. It knows nothing of how the plan was made.
"""

import pytest

from mt_parallel.dualpipev import BackwardInput, Forward, ForwardBackward, dualpipev_schedule
from mt_parallel.pipeline_comm import ACTIVATION, Message, _needs, _sends, message_plan


def _operations(schedule, plan, pp):
    """Per rank, its batches in issue order: lists of ("recv" | "send", peer, message)."""
    ranks = []
    for r, actions in enumerate(schedule):
        batches = []
        for action, receives in zip(actions, plan[r], strict=True):
            if receives:
                batches.append([("recv", m.sender, m) for m in receives])
            batches += [[("send", m.receiver, m)] for m in _sends(action, r, pp)
                        if m.sender != m.receiver]  # fmt: skip
        ranks.append(batches)
    return ranks


def _replay(ranks):
    """Runs the batches under rendezvous semantics; returns the messages in completion
    order. Raises AssertionError on a mismatched pair or a deadlock."""
    heads = [0] * len(ranks)
    pending = [list(b[0]) if b else [] for b in ranks]
    done = []
    while any(h < len(b) for h, b in zip(heads, ranks, strict=True)):
        progress = False
        for a in range(len(ranks)):
            sends = [op for op in pending[a] if op[0] == "send"]
            for op in sends:
                b = op[1]
                # NCCL matches a pair's operations in order: the first pending send from a
                # to b in a's batch with the first pending receive from a in b's.
                if op is not next(o for o in pending[a] if o[0] == "send" and o[1] == b):
                    continue
                recv = next((o for o in pending[b] if o[0] == "recv" and o[1] == a), None)
                if recv is None:
                    continue
                assert recv[2] == op[2], f"rank {b} receives {recv[2]} from rank {a}: {op[2]}"
                pending[a].remove(op)
                pending[b].remove(recv)
                done.append(op[2])
                progress = True
        for r in range(len(ranks)):
            while heads[r] < len(ranks[r]) and not pending[r]:
                heads[r] += 1
                pending[r] = list(ranks[r][heads[r]]) if heads[r] < len(ranks[r]) else []
                progress = True
        assert progress, f"deadlock: heads {heads}, pending {pending}"
    return done


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_plan_matches_without_tags_and_cannot_deadlock(pp):
    for num_micro_batches in (2 * pp, 2 * pp + 1, 3 * pp + 2, 20):
        schedule = dualpipev_schedule(pp, num_micro_batches)
        plan = message_plan(schedule, pp)
        done = _replay(_operations(schedule, plan, pp))
        remote = [m for r, actions in enumerate(schedule) for a in actions
                  for m in _sends(a, r, pp) if m.sender != m.receiver]  # fmt: skip
        assert sorted(done, key=str) == sorted(remote, key=str)
        assert len(set(done)) == len(done) == 4 * (pp - 1) * num_micro_batches
        for r, actions in enumerate(schedule):  # each receive posted before it is needed
            posted = set()
            for action, receives in zip(actions, plan[r], strict=True):
                posted |= set(receives)
                needed = {m for m in _needs(action, r, pp) if m.sender != m.receiver}
                assert needed <= posted, (r, action, needed - posted)


def test_replay_finds_a_wrong_order_and_a_deadlock():
    # The check can fail: rank 1 posting its first two receives the other way round
    # mismatches; receiving only after its own sends, with rank 0 doing the same, hangs.
    pp, m = 2, 4
    schedule = dualpipev_schedule(pp, m)
    plan = message_plan(schedule, pp)
    ranks = _operations(schedule, plan, pp)
    first = next(i for i, batch in enumerate(ranks[1]) if batch[0][0] == "recv")
    second = next(i for i in range(first + 1, len(ranks[1])) if ranks[1][i][0][0] == "recv")
    wrong = [list(batch) for batch in ranks[1]]
    wrong[first] = [wrong[second].pop(0), *wrong[first]]
    wrong = [batch for batch in wrong if batch]
    with pytest.raises(AssertionError, match="rank 1 receives"):
        _replay([ranks[0], wrong])
    send = Message(ACTIVATION, 1, 0, 0, 1)
    back = Message(ACTIVATION, 0, 0, 1, 0)  # not a real message: a crossing pair
    crossed = [[[("send", 1, send)], [("recv", 1, back)]],
               [[("send", 0, back)], [("recv", 0, send)]]]  # fmt: skip
    with pytest.raises(AssertionError, match="deadlock"):
        _replay(crossed)


@pytest.mark.parametrize("pp", [2, 4])
def test_receiving_only_what_each_action_needs_would_deadlock(pp):
    # Why the plan receives ahead: rank 0's warm-up sends several activations before
    # rank 1's first action needs one, and with a send waiting for its receive, posting
    # only the receives an action needs leaves rank 0 blocked on its second send while
    # rank 1 is blocked sending back to it.
    schedule = dualpipev_schedule(pp, 2 * pp + 2)
    just_in_time = [[[m for m in _needs(a, r, pp) if m.sender != m.receiver] for a in actions]
                    for r, actions in enumerate(schedule)]  # fmt: skip
    with pytest.raises(AssertionError, match="deadlock"):
        _replay(_operations(schedule, just_in_time, pp))


def test_a_deadlocking_schedule_is_a_value_error_naming_pp_and_each_blocked_rank():
    # It was an assert (gone under python -O, where the loop then never ended) naming
    # only how far each rank got.
    pp = 2
    schedule = dualpipev_schedule(pp, 4)
    schedule[0][0], schedule[0][3] = schedule[0][3], schedule[0][0]  # F1[0] first on rank 0
    with pytest.raises(ValueError) as info:
        message_plan(schedule, pp)
    message = str(info.value)
    assert message.startswith("message_plan (pp=2): the schedule deadlocks: "), message
    for blocked in (
        "rank 0 at action 0 (F1[0]) waits for stage 3's input of micro-batch 0 from rank 1",
        "rank 1 at action 0 (F0[0]) waits for stage 1's input of micro-batch 0 from rank 0",
    ):
        assert blocked in message


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("F0[0]", r"rank 1 action 2 \('F0\[0\]'\) is not a DualPipeV action"),
        (Forward(2, 0), r"rank 1 action 2 \(F2\[0\]\): chunk must be 0 or 1"),
        (
            ForwardBackward(Forward(0, 0), BackwardInput(1, 0)),
            r"rank 1 action 2 .* must pair a Forward with a Backward",
        ),
    ],
)
def test_a_schedule_with_a_foreign_action_is_a_value_error_naming_pp_and_where(action, message):
    # A string failed as an AttributeError inside the plan, chunk 2 as stage_of's assert
    # and the mispaired ForwardBackward as a deadlock assert naming no action.
    schedule = dualpipev_schedule(2, 4)
    schedule[1][2] = action
    with pytest.raises(ValueError, match=r"^message_plan \(pp=2\): " + message):
        message_plan(schedule, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda actions: actions + [Forward(1, 2)],
         "rank 0 action 16 (F1[2]) takes stage 3's input of micro-batch 2 from rank 1 a second "
         "time: the schedule must run each stage's forward and backward once per micro-batch"),
        (lambda actions: actions + [Forward(0, 3)],
         "rank 0 action 16 (F0[3]) sends stage 1's input of micro-batch 3 from rank 0 a second "
         "time: "),
        (lambda actions: [a for a in actions if str(a) != "B0[3]"],
         "no action takes stage 0's output gradient of micro-batch 3 from rank 1 (rank 0's "
         "B0[3] is missing): "),
    ],
)  # fmt: skip
def test_a_message_sent_or_taken_twice_or_never_taken_is_a_value_error_naming_it(change, message):
    # Repeating stage 3's forward (it sends nothing) was planned silently, and so was a
    # missing backward whose rank still had actions: the executor found it only at the
    # end of the step. A repeated send was an assert listing every message key.
    schedule = dualpipev_schedule(2, 4)
    assert "B0[3]" in map(str, schedule[0])
    schedule[0] = change(schedule[0])
    with pytest.raises(ValueError) as info:
        message_plan(schedule, 2)
    assert str(info.value).startswith(f"message_plan (pp=2): {message}"), str(info.value)


def test_a_schedule_for_another_pp_or_a_bad_pp_is_a_value_error():
    with pytest.raises(ValueError, match=r"^message_plan \(pp=2\): the schedule has 3 rank "
                       r"lists; pp \(2\) needs 2"):  # fmt: skip
        message_plan(dualpipev_schedule(3, 6), 2)
    with pytest.raises(ValueError, match=r"^message_plan: pp \(0\) must be an integer >= 1"):
        message_plan([], 0)


def test_a_backward_before_its_own_forward_on_one_rank_is_a_value_error_naming_both():
    # The last stage's backward starts from its loss, so no message orders it after its
    # forward: the plan accepted it, and the executor failed on a missing saved forward.
    schedule = dualpipev_schedule(2, 4)
    actions = [str(a) for a in schedule[0]]
    forward = actions.index("F1[0]")  # rank 0 holds stage 3, the last
    backward = next(i for i, a in enumerate(actions) if "B1[0]" in a or "BW1[0]" in a)
    assert forward < backward
    schedule[0].insert(forward, schedule[0].pop(backward))
    with pytest.raises(ValueError) as info:
        message_plan(schedule, 2)
    message = str(info.value)
    assert message.startswith(f"message_plan (pp=2): rank 0 action {forward} ("), message
    assert "before F1[0] of rank 0 (stage 3)" in message, message
