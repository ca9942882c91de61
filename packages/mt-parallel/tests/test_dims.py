import pytest
import torch

from mt_parallel import ParallelDims, zigzag_ranges
from mt_parallel.testing import check_layout_errors_name_the_fix, spawn


def test_dp_is_derived_from_the_world_size():
    dims = ParallelDims(world_size=8, pp=1, cp=2, ep=2)
    assert dims.dp == 2 and dims.batch_ranks == 4


def test_sizes_that_do_not_multiply_to_the_world_size_are_rejected():
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelDims(world_size=8, dp=3)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims(world_size=6, ep=4)


def test_a_mismatched_explicit_dp_names_the_fix_that_works():
    # Both cases said "set parallel.dp=-1 to derive dp", which fails for cp=3 on 8 ranks.
    with pytest.raises(ValueError, match=r"set parallel.dp=2 \(or -1, which derives it\)"):
        ParallelDims(world_size=8, dp=3, ep=4)
    with pytest.raises(ValueError, match=r"pp\*cp\*ep \(1\*3\*1=3\) does not divide") as err:
        ParallelDims(world_size=8, dp=1, cp=3)
    assert "dp=-1" not in str(err.value), err.value


def test_expert_parallel_size_must_divide_the_experts():
    dims = ParallelDims(world_size=3, ep=3)
    with pytest.raises(ValueError, match=r"parallel.ep \(3\) must divide num_experts \(8\)"):
        dims.validate_model(num_experts=8, num_heads=4, seq_len=64)


def test_an_ep_that_does_not_divide_the_experts_names_every_size_that_fits_the_world():
    # Before: the first 8 divisors of 384, [1, 2, 3, 4, 6, 8, 12, 16]: 3, 6 and 12 do not
    # fit 256 ranks, and 32, 64 and 128, which do, were left out.
    dims = ParallelDims(world_size=256, ep=256)
    fits = r"choose one of \[1, 2, 4, 8, 16, 32, 64, 128\]"
    with pytest.raises(
        ValueError, match=r"parallel.ep \(256\) must divide num_experts \(384\); " + fits
    ):
        dims.validate_model(num_experts=384, num_heads=4, seq_len=64)
    # With cp = 2 on 8 ranks, 4 ranks are left for dp*ep: 3 divides 6 experts, not them.
    dims = ParallelDims(world_size=8, cp=2, ep=4)
    with pytest.raises(ValueError, match=r"choose one of \[1, 2\] \(.*world_size / \(pp\*cp\) = 4"):
        dims.validate_model(num_experts=6, num_heads=4, seq_len=64)


def test_sizes_whose_product_does_not_divide_the_world_name_the_sizes_that_do():
    with pytest.raises(ValueError, match=r"pp\*cp=1: parallel.ep one of \[1, 2, 3, 6\]"):
        ParallelDims(world_size=6, ep=4)
    with pytest.raises(
        ValueError, match=r"pp\*cp\*ep \(1\*3\*1=3\) does not divide it.* one of \[1, 2, 4, 8\]"
    ):
        ParallelDims(world_size=8, dp=1, cp=3)


def test_context_parallel_size_must_fit_the_sequence():
    dims = ParallelDims(world_size=2, cp=2)
    fix = r"use seq_len 64 or 68, or parallel.cp one of \[1, 3, 11, 33\]"
    on_2_ranks = r"use seq_len 64 or 68, or parallel.cp one of \[1\]"  # 3, 11, 33 do not fit
    with pytest.raises(ValueError, match=r"seq_len \(66\) .* 2\*parallel.cp \(4\) .*" + on_2_ranks):
        dims.validate_model(num_experts=8, num_heads=4, seq_len=66)
    with pytest.raises(ValueError, match=r"seq_len \(66\) .*" + fix):
        zigzag_ranges(66, 2, 0)
    dims.validate_model(num_experts=8, num_heads=4, seq_len=64)
    ParallelDims(world_size=1).validate_model(num_experts=8, num_heads=4, seq_len=1023)
    ParallelDims(world_size=8, cp=8).validate_model(num_experts=8, num_heads=4, seq_len=64)


def test_a_cp_that_does_not_fit_the_sequence_names_only_cp_sizes_that_fit_the_world():
    # Before: "parallel.cp one of [1, 3, 11, 33]" on 8 ranks, where 3, 11 and 33 cannot be
    # laid out; on 12 ranks with ep 2 (6 ranks for dp*cp) 1 and 3 fit.
    with pytest.raises(ValueError, match=r"use seq_len 64 or 68, or parallel.cp one of \[1\] \("):
        ParallelDims(world_size=8, cp=2).validate_model(num_experts=8, num_heads=4, seq_len=66)
    dims = ParallelDims(world_size=12, cp=2, ep=2)
    with pytest.raises(ValueError, match=r"parallel.cp one of \[1, 3\] \(.* = 6\)"):
        dims.validate_model(num_experts=8, num_heads=4, seq_len=66)


@pytest.mark.parametrize("seq_len", [0, -4, 2])
def test_a_sequence_shorter_than_two_cp_chunks_is_refused_naming_seq_len_and_cp(seq_len):
    dims = ParallelDims(world_size=2, cp=2)
    message = rf"seq_len \({seq_len}\) must be >= 2\*parallel.cp \(4\).*multiple of 4"
    with pytest.raises(ValueError, match=message):
        dims.validate_model(num_experts=8, num_heads=4, seq_len=seq_len)
    with pytest.raises(ValueError, match=message):
        zigzag_ranges(seq_len, 2, 0)


def test_a_micro_batch_that_does_not_fit_the_batch_ranks_gets_sizes_that_do():
    from mt_parallel.parallelize import check_batch_split

    with pytest.raises(ValueError, match=r"use one of \[4, 12\]"):
        check_batch_split(12, 6, ParallelDims(world_size=4))
    with pytest.raises(ValueError, match="make training.global_batch_size a multiple of 4"):
        check_batch_split(10, 5, ParallelDims(world_size=4))


def test_a_micro_batch_that_does_not_divide_the_global_batch_gets_sizes_that_do():
    from mt_parallel.parallelize import check_batch_split

    # Before: only "must divide training.global_batch_size (12)", no size that works.
    with pytest.raises(ValueError, match=r"must divide .*\(12\); use one of \[2, 4, 6, 12\]"):
        check_batch_split(12, 5, ParallelDims(world_size=2))
    with pytest.raises(ValueError, match=r"must divide .*\(10\); no micro-batch size fits"):
        check_batch_split(10, 4, ParallelDims(world_size=4))


@pytest.mark.parametrize(("global_batch", "micro_batch"), [(8, 0), (0, 4), (-4, 4)])
def test_batch_sizes_below_one_are_rejected_naming_them(global_batch, micro_batch):
    from mt_parallel.parallelize import check_batch_split

    with pytest.raises(ValueError, match=rf"\({global_batch}\) and .* \({micro_batch}\)"):
        check_batch_split(global_batch, micro_batch, ParallelDims(world_size=4, ep=2))


def test_a_batch_rank_outside_the_batch_ranks_is_rejected_not_given_no_rows():
    from mt_parallel.parallelize import rank_batch_slices

    tokens = torch.arange(8 * 17).view(8, 17)
    dims = ParallelDims(world_size=4, cp=2)  # dp 2: batch ranks 0 and 1
    assert [inputs.shape for _, inputs, _, _ in rank_batch_slices(tokens, 4, dims, 1, 1)] == [
        (2, 8),
        (2, 8),
    ]
    with pytest.raises(ValueError, match=r"batch_rank \(3\) must be in \[0, dp\*ep=2\)"):
        next(rank_batch_slices(tokens, 4, dims, 3, 0))


@pytest.mark.parametrize(("cp", "cp_rank"), [(2, 2), (2, -1), (0, 0)])
def test_a_cp_rank_outside_the_cp_group_is_rejected_not_given_other_chunks(cp, cp_rank):
    from mt_parallel import zigzag_ranges

    with pytest.raises(ValueError, match=rf"cp \({cp}\) must be >= 1 and cp_rank \({cp_rank}\)"):
        zigzag_ranges(16, cp, cp_rank)


def test_a_layout_that_does_not_fit_the_experts_or_the_world_names_the_sizes_that_do():
    spawn(check_layout_errors_name_the_fix, 3)


@pytest.mark.parametrize(
    ("sizes", "pattern"),
    [
        # 2.5 * 1.6 == 4: accepted, and a mesh of 2.5 ranks failed later, far from the cause.
        ({"world_size": 4, "dp": 2.5, "ep": 1.6}, r"parallel.dp \(2.5\) must be a whole number"),
        ({"world_size": 4, "ep": 2.0}, r"parallel.ep \(2.0\) must be a whole number .* ep=2\b"),
        ({"world_size": 4.0}, r"parallel.world_size \(4.0\) must be a whole number"),
        ({"world_size": 2, "cp": True}, r"parallel.cp \(True\) must be a whole number .* bool"),
    ],
)
def test_sizes_that_are_not_whole_numbers_are_rejected_naming_them(sizes, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelDims(**sizes)


def test_numpy_integer_sizes_are_taken_as_ints():
    import numpy as np

    dims = ParallelDims(world_size=np.int64(4), ep=np.int32(2))
    assert (dims.world_size, dims.dp, dims.ep) == (4, 2, 2)
    assert all(type(v) is int for v in (dims.world_size, dims.pp, dims.dp, dims.cp, dims.ep))


def test_parallelize_refuses_a_materialized_model_and_keeps_its_weights():
    # A loaded model (load_hf, or init_weights already run) was re-materialized and
    # overwritten by init_weights(seed) without a word: its weights were lost.
    from mt_models import build_model, qwen3_moe
    from mt_parallel import parallelize

    model = build_model(qwen3_moe.debug())
    model.init_weights(1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight is on cpu.*load_hf_into"):
        parallelize(model, ParallelDims(world_size=1), "cpu", seed=0)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_rank_batch_slices_names_only_cp_sizes_that_fit_the_world_for_a_bad_seq_len():
    # It named cp 3, 5 or 15 for seq_len 30 on 8 ranks with ep=2 (zigzag_ranges' check,
    # which does not know the world), sizes no such layout can take.
    from mt_parallel import rank_batch_slices

    dims = ParallelDims(world_size=8, cp=2, ep=2)
    tokens = torch.zeros(8, 31, dtype=torch.long)
    pattern = r"parallel.cp one of \[1\] \(those that also divide world_size / \(pp\*ep\) = 4\)"
    with pytest.raises(ValueError, match=pattern):
        next(rank_batch_slices(tokens, 4, dims, batch_rank=0, cp_rank=0))
