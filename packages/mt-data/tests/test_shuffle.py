"""IndexPermutation: a seeded permutation evaluated position by position."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mt_data.shuffle import IndexPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4097, 65_537])
def test_every_position_maps_to_a_distinct_sample_in_range(n):
    values = IndexPermutation(n, [0, 0, 0])(np.arange(n))
    assert values.dtype == np.int64
    assert np.array_equal(np.sort(values), np.arange(n))


def test_the_key_chooses_the_order_and_lookups_are_pointwise():
    n = 10_000
    a = IndexPermutation(n, [1, 0, 0])(np.arange(n))
    assert not np.array_equal(a, IndexPermutation(n, [1, 0, 1])(np.arange(n)))
    assert not np.array_equal(a, IndexPermutation(n, [2, 0, 0])(np.arange(n)))
    np.testing.assert_array_equal(a, IndexPermutation(n, [1, 0, 0])(np.arange(n)))
    positions = np.array([9_999, 0, 5_000, 5_000])
    np.testing.assert_array_equal(IndexPermutation(n, [1, 0, 0])(positions), a[positions])


def test_a_single_position_gives_the_value_of_the_whole_order_without_warnings():
    n = 1000
    permutation = IndexPermutation(n, [0, 0, 0])
    values = permutation(np.arange(n))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrapping multiplications warned on scalars
        single = [permutation(i) for i in range(n)]  # some need cycle walking: TypeError
    assert all(np.shape(v) == () for v in single)
    assert [int(v) for v in single] == values.tolist()
    assert permutation(np.arange(6).reshape(2, 3)).tolist() == values[:6].reshape(2, 3).tolist()


def test_the_order_looks_shuffled():
    n = 100_000
    values = IndexPermutation(n, [7]).__call__(np.arange(n))
    # Few fixed points (about 1 expected) and neighbours land far apart.
    assert int((values == np.arange(n)).sum()) < 10
    assert np.median(np.abs(np.diff(values))) > n / 10
    # Each tenth of the positions spreads over the whole range.
    first_tenth = values[: n // 10]
    assert np.histogram(first_tenth, bins=10, range=(0, n))[0].min() > 800


def test_positions_out_of_range_and_bad_sizes_are_rejected():
    with pytest.raises(IndexError, match="out of range"):
        IndexPermutation(5, [0])(np.array([5]))
    with pytest.raises(ValueError, match="positive integer"):
        IndexPermutation(0, [0])
