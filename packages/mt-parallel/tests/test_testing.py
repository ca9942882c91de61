"""The checking helpers report the same thing whichever rank `spawn` surfaces (gloo, CPU)."""

from mt_parallel.testing import check_routing_report_is_rank_independent, spawn


def test_routing_mismatch_is_reported_the_same_on_every_rank():
    spawn(check_routing_report_is_rank_independent, 2)
