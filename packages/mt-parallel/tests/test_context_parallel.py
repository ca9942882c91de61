"""The context-parallel attention core takes the positions the AttentionCore protocol
allows ([S] or [B, S]) and names missing ones (gloo, CPU, two ranks)."""

from mt_parallel.testing import check_context_parallel_positions, spawn


def test_context_parallel_core_takes_positions_per_row_and_names_missing_ones():
    spawn(check_context_parallel_positions, 2)
