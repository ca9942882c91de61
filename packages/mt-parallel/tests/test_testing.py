"""The checking helpers report the same thing whichever rank `spawn` surfaces (gloo, CPU)."""

from mt_parallel.testing import (
    check_mesh_ranks_of_flattened_axes,
    check_routing_report_is_rank_independent,
    spawn,
)


def test_routing_mismatch_is_reported_the_same_on_every_rank():
    spawn(check_routing_report_is_rank_independent, 2)


def test_reference_routing_is_cut_for_a_layout_without_cp_at_an_odd_sequence_length():
    # Cutting went through zigzag_positions, which needs seq_len divisible by 2*cp even
    # for cp = 1, so compare_layout refused a dp/ep layout at seq_len 15.
    import torch

    from mt_parallel import ParallelDims
    from mt_parallel.testing import _rank_topk

    ids = torch.arange(4 * 15 * 2).view(4 * 15, 2)  # one router call: micro 4, S 15, K 2
    dims = ParallelDims(world_size=2, dp=2)
    for batch_rank in range(2):
        (mine,) = _rank_topk([ids], dims, batch_rank, 0, micro=4, seq_len=15)
        assert torch.equal(mine, ids[batch_rank * 30 : (batch_rank + 1) * 30])


def test_mesh_ranks_of_flattened_axes_come_from_the_kept_meshes_without_warnings():
    # rank() sliced "dp_ep" etc. from the root mesh, which torch 2.11 warns is deprecated;
    # group() already used the kept flattened meshes.
    spawn(check_mesh_ranks_of_flattened_axes, 2)


class _SlowToFormat(AssertionError):
    """An error whose traceback takes a second to format (a long one can): the failing
    rank reports it to spawn after its peer has found it gone."""

    def __str__(self):
        import time

        time.sleep(1)
        return "rank 1's own failure"


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise _SlowToFormat


def test_spawn_reports_the_failing_rank_not_its_peer_left_at_the_final_barrier(monkeypatch):
    # Rank 0 passes and waits at spawn's final barrier; rank 1 fails and leaves. The
    # barrier's broken connection on rank 0 ('Connection closed by peer') was raised as
    # rank 0's error, and spawn reported it instead of rank 1's traceback (8 runs in 10).
    from pathlib import Path

    import pytest
    from torch.multiprocessing import ProcessRaisedException

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # spawned ranks import this file
    targets = __import__(Path(__file__).stem)
    with pytest.raises(ProcessRaisedException) as raised:
        spawn(targets._fail_on_rank_1, 2)
    assert raised.value.error_index == 1, str(raised.value)
    assert "rank 1's own failure" in str(raised.value), str(raised.value)


def test_spawn_kills_ranks_that_run_past_timeout_s():
    # A hang (ranks waiting on messages that never come) fails instead of stalling.
    import time

    import pytest

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"spawn\(sleep, 2\) was still running after "
                                           r"timeout_s=3 s and was killed"):  # fmt: skip
        spawn(time.sleep, 2, 600, timeout_s=3)
    assert time.monotonic() - start < 60
