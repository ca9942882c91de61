"""TokenDataset for parallel training: CP slices, document positions, mixing, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mt_data import DataExhausted, IndexedDatasetWriter, TokenDataset, zigzag_ranges

SEQ_LEN = 8
EOS = 0


def _write_corpus(directory, shard_lengths, first_token=1, seed=0):
    """Shards of documents ending with EOS; returns the concatenated stream."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stream: list[int] = []
    for s, lengths in enumerate(shard_lengths):
        with IndexedDatasetWriter(directory / f"shard{s}", np.uint16) as writer:
            for n in lengths:
                doc = [*rng.integers(first_token, first_token + 1000, size=n - 1).tolist(), EOS]
                writer.add_document(doc)
                stream.extend(doc)
    return np.array(stream, dtype=np.int64)


@pytest.fixture
def corpus(tmp_path):
    stream = _write_corpus(tmp_path / "c", [[5, 1, 13, 4], [], [3, 30, 2, 9, 11, 1, 7]])
    return tmp_path / "c", stream


def test_zigzag_ranges_give_each_rank_two_chunks_with_their_label_token():
    assert zigzag_ranges(8, 2, 0) == [(0, 3), (6, 9)]
    assert zigzag_ranges(8, 2, 1) == [(2, 5), (4, 7)]
    assert zigzag_ranges(8, 1, 0) == [(0, 5), (4, 9)]
    inputs = [c for r in range(4) for a, b in zigzag_ranges(16, 4, r) for c in range(a, b - 1)]
    covered = sorted(inputs)
    assert covered == list(range(16))  # the inputs of all ranks tile the sequence once
    with pytest.raises(ValueError, match=r"multiple of 2·cp \(4\)"):
        zigzag_ranges(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_ranges(8, 2, 2)


def test_token_ranges_return_exactly_those_columns_of_the_full_samples(corpus):
    full = TokenDataset(corpus[0], SEQ_LEN, seed=3)
    cp_ranks = [TokenDataset(corpus[0], SEQ_LEN, seed=3) for _ in range(2)]
    for _ in range(6):  # crosses epochs (9 samples per epoch) and shard boundaries
        expected = full.take(4, rank=1, world_size=2)
        for cp_rank, dataset in enumerate(cp_ranks):
            ranges = zigzag_ranges(SEQ_LEN, 2, cp_rank)
            part = dataset.take(4, rank=1, world_size=2, token_ranges=ranges)
            assert part.shape == (2, sum(b - a for a, b in ranges))
            np.testing.assert_array_equal(
                part, np.concatenate([expected[:, a:b] for a, b in ranges], axis=1)
            )
    with pytest.raises(ValueError, match="token_ranges"):
        full.take(2, token_ranges=[(3, 3)])
    with pytest.raises(ValueError, match="token_ranges"):
        full.take(2, token_ranges=[(0, SEQ_LEN + 2)])
    for bad in [(0, 3), [(0.5, 3)], [(0, 2, 3)], ["03"], "03"]:  # one pair, floats, ...
        with pytest.raises(ValueError, match="token_ranges"):
            full.take(2, token_ranges=bad)
    assert full.consumed_samples == 24  # refused calls consume nothing
    as_array = full.take(2, token_ranges=np.array(zigzag_ranges(SEQ_LEN, 2, 0)))
    assert as_array.shape == (2, sum(b - a for a, b in zigzag_ranges(SEQ_LEN, 2, 0)))


def _naive_positions(row: np.ndarray, first: int, stream: np.ndarray) -> list[int]:
    """Tokens since the last document start (a token after EOS), from the sample start."""
    out, position = [], 0
    for i in range(len(row)):
        at = first + i
        if i > 0 and stream[at - 1] == EOS:
            position = 0
        out.append(position)
        position += 1
    return out


def test_positions_restart_at_each_document_start_across_shards(corpus):
    data_dir, stream = corpus
    dataset = TokenDataset(data_dir, SEQ_LEN, seed=1)
    n = dataset.num_samples
    tokens, positions = dataset.take(n, return_positions=True)
    order = dataset.permutation(0)
    for row, j in enumerate(order):
        first = int(j) * SEQ_LEN
        np.testing.assert_array_equal(tokens[row], stream[first : first + SEQ_LEN + 1])
        assert positions[row].tolist() == _naive_positions(tokens[row], first, stream)
    assert (positions == 0).sum() > n  # the fixture's documents do start inside samples
    # Sliced positions are the same columns of the whole sample's positions.
    again = TokenDataset(data_dir, SEQ_LEN, seed=1)
    ranges = zigzag_ranges(SEQ_LEN, 2, 1)
    _, sliced = again.take(n, token_ranges=ranges, return_positions=True)
    np.testing.assert_array_equal(
        sliced, np.concatenate([positions[:, a:b] for a, b in ranges], axis=1)
    )


def test_a_list_of_paths_is_one_corpus_read_in_order(tmp_path):
    first = _write_corpus(tmp_path / "a", [[6, 7]], seed=1)
    second = _write_corpus(tmp_path / "b", [[9, 4]], seed=2)
    dataset = TokenDataset([tmp_path / "a", tmp_path / "b" / "shard0"], SEQ_LEN)
    stream = np.concatenate([first, second])
    assert dataset.num_tokens == len(stream)
    for j in range(dataset.num_samples):
        np.testing.assert_array_equal(dataset.sample(j), stream[j * SEQ_LEN : j * SEQ_LEN + 9])


@pytest.fixture
def mix(tmp_path):
    _write_corpus(tmp_path / "big", [[40] * 10], first_token=1, seed=1)  # 49 samples
    _write_corpus(tmp_path / "small", [[20] * 2], first_token=5000, seed=2)  # 4 samples
    return {tmp_path / "big": 3.0, tmp_path / "small": 1.0}


def test_a_weighted_mix_draws_from_each_corpus_in_proportion(mix):
    dataset = TokenDataset(mix, SEQ_LEN, seed=0)
    assert len(dataset.corpora) == 2
    batch = dataset.take(400)
    from_small = batch[:, 0] >= 5000
    assert int(from_small.sum()) == 100  # exactly a quarter: the greedy rule has no drift
    # With two corpora any prefix stays within one sample of its share.
    shares = np.cumsum(from_small) - 0.25 * np.arange(1, 401)
    assert np.abs(shares).max() <= 1
    assert dataset.state_dict()["corpora"][1]["consumed_samples"] == 100
    assert dataset.state_dict()["corpora"][1]["epoch"] == 25  # the small corpus repeats


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, "2"])
def test_a_mix_weight_that_is_not_a_positive_finite_number_is_refused(mix, bad):
    small = next(path for path in mix if path.name == "small")
    with pytest.raises(ValueError, match=rf"weight of {small} .* positive finite number"):
        TokenDataset({**mix, small: bad}, SEQ_LEN)


def test_numpy_weights_mix_like_python_numbers(mix):
    python = TokenDataset(mix, SEQ_LEN, seed=0)
    numpy = TokenDataset({p: np.float32(w) for p, w in mix.items()}, SEQ_LEN, seed=0)
    np.testing.assert_array_equal(numpy.take(40), python.take(40))
    assert json.loads(json.dumps(numpy.state_dict())) == python.state_dict()


def test_a_mix_splits_over_ranks_and_resumes_exactly(mix):
    single = TokenDataset(mix, SEQ_LEN, seed=5)
    expected = [single.take(8) for _ in range(6)]
    ranks = [TokenDataset(mix, SEQ_LEN, seed=5) for _ in range(4)]
    for step in range(3):
        parts = [d.take(8, rank=r, world_size=4) for r, d in enumerate(ranks)]
        np.testing.assert_array_equal(np.concatenate(parts), expected[step])
    state = json.loads(json.dumps(ranks[2].state_dict()))
    assert state == ranks[0].state_dict()  # the state does not depend on the rank
    resumed = TokenDataset(mix, SEQ_LEN, seed=0)
    resumed.load_state_dict(state)
    for step in range(3, 6):
        np.testing.assert_array_equal(resumed.take(8), expected[step])
    reweighted = TokenDataset({**mix, next(iter(mix)): 1.0}, SEQ_LEN)
    with pytest.raises(ValueError, match="resume with the original weights"):
        reweighted.load_state_dict(state)


def test_stop_policy_on_a_mix_stops_when_any_corpus_would_repeat(mix):
    dataset = TokenDataset(mix, SEQ_LEN, on_exhausted="stop")
    dataset.take(16)  # 4 from the small corpus: all of it
    with pytest.raises(DataExhausted, match="corpus 1 of the mix.*0 of 4 samples left"):
        dataset.take(4)
    assert dataset.consumed_samples == 16


def test_resume_with_token_ranges_and_positions_matches_an_uninterrupted_run(corpus):
    ranges = zigzag_ranges(SEQ_LEN, 2, 0)
    uninterrupted = TokenDataset(corpus[0], SEQ_LEN, seed=9)
    expected = [uninterrupted.take(6, token_ranges=ranges, return_positions=True) for _ in range(5)]
    first = TokenDataset(corpus[0], SEQ_LEN, seed=9)
    for _ in range(2):
        first.take(6, token_ranges=ranges)
    resumed = TokenDataset(corpus[0], SEQ_LEN, seed=9)
    resumed.load_state_dict(first.state_dict())
    for tokens, positions in expected[2:]:
        got_tokens, got_positions = resumed.take(6, token_ranges=ranges, return_positions=True)
        np.testing.assert_array_equal(got_tokens, tokens)
        np.testing.assert_array_equal(got_positions, positions)


def test_corpora_built_with_different_tokenizers_cannot_be_mixed(tmp_path, mix):
    for directory, eos in zip(mix, (0, 1), strict=True):
        (directory / "manifest.json").write_text(json.dumps({"eos_id": eos}))
    with pytest.raises(ValueError, match="different tokenizers"):
        TokenDataset(mix, SEQ_LEN)
