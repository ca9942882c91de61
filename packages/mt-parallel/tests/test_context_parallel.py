"""The context-parallel attention core takes the positions the AttentionCore protocol
allows ([S] or [B, S]), names missing ones and refuses per-document ones (gloo, CPU,
two ranks); `split_sample` cuts inputs, labels and positions out of whole or pre-cut
samples."""

import pytest
import torch

from mt_parallel import zigzag_ranges
from mt_parallel.context_parallel import split_sample
from mt_parallel.testing import (
    check_context_parallel_gather_leaves_shared_gradients_alone,
    check_context_parallel_positions,
    check_context_parallel_refuses_document_positions,
    spawn,
)


def test_context_parallel_core_takes_positions_per_row_and_names_missing_ones():
    spawn(check_context_parallel_positions, 2)


def test_context_parallel_core_refuses_per_document_positions_of_packed_samples():
    spawn(check_context_parallel_refuses_document_positions, 2)


def test_key_value_gather_backward_leaves_a_gradient_shared_with_another_branch_alone():
    # Its backward all-reduced the incoming gradient in place: where another branch got the
    # same tensor (the backward of an add hands both operands one), that branch's gradient
    # came out cp times too large.
    spawn(check_context_parallel_gather_leaves_shared_gradients_alone, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_sample_gives_the_same_tokens_from_whole_and_from_cut_samples(cp):
    # cp = 1 is the case where the cut layout (S + 2 columns: the chunks share a label
    # column) is wider than the whole sample (S + 1); it was taken for a cut one.
    seq_len = 16
    tokens = torch.arange(2 * (seq_len + 1)).view(2, seq_len + 1)
    for cp_rank in range(cp):
        ranges = zigzag_ranges(seq_len, cp, cp_rank)
        cut = torch.cat([tokens[:, a:b] for a, b in ranges], dim=1)
        for sample in (tokens, cut):
            inputs, labels, positions = split_sample(sample, ranges)
            assert torch.equal(inputs, tokens[:, positions]), (cp, cp_rank, sample.shape)
            assert torch.equal(labels, tokens[:, positions + 1]), (cp, cp_rank, sample.shape)
            assert positions.numel() == seq_len // cp


def test_split_sample_refuses_samples_that_fit_neither_layout_naming_both():
    ranges = zigzag_ranges(16, 2, 0)  # [(0, 5), (12, 17)]: 10 columns cut, 17 whole
    with pytest.raises(ValueError, match=r"\(\(2, 12\)\) must be \[B, S\+1\] .* or \[B, 10\]"):
        split_sample(torch.zeros(2, 12, dtype=torch.long), ranges)


def test_split_sample_refuses_tokens_that_are_not_2d_naming_the_batch_dim():
    # A single [S+1] sample failed with "IndexError: tuple index out of range".
    ranges = zigzag_ranges(16, 2, 0)
    with pytest.raises(ValueError, match=r"\(\(17,\)\) must be \[B, S\+1\] .* tokens\[None\]"):
        split_sample(torch.arange(17), ranges)
    with pytest.raises(ValueError, match=r"\(\(1, 2, 17\)\) must be \[B, S\+1\]"):
        split_sample(torch.zeros(1, 2, 17, dtype=torch.long), ranges)
