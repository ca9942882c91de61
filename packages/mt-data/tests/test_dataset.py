"""TokenDataset: packing across shards, per-epoch shuffle, rank slices, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mt_data import DataExhausted, IndexedDatasetWriter, TokenDataset

SEQ_LEN = 8


@pytest.fixture
def corpus(tmp_path):
    """Three shards (one empty) of documents ending in EOS=0, plus their naive concatenation."""
    rng = np.random.default_rng(1)
    stream = []
    shard_docs = [
        [rng.integers(1, 60000, size=n) for n in (5, 1, 13)],
        [],
        [rng.integers(1, 60000, size=n) for n in (3, 30, 2, 9, 11)],
    ]
    for name, docs in zip(("a", "b", "c"), shard_docs, strict=True):
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as writer:
            for doc in docs:
                tokens = np.append(doc, 0)
                writer.add_document(tokens)
                stream.extend(tokens.tolist())
    return tmp_path, np.array(stream, dtype=np.int64)


def test_samples_match_a_naive_concatenation_across_shard_boundaries(corpus):
    data_dir, stream = corpus
    dataset = TokenDataset(data_dir, SEQ_LEN)
    assert dataset.num_tokens == len(stream) == 82
    assert dataset.num_samples == len(dataset) == (len(stream) - 1) // SEQ_LEN
    for j in range(dataset.num_samples):
        sample = dataset.sample(j)
        assert sample.dtype == np.int64 and sample.shape == (SEQ_LEN + 1,)
        np.testing.assert_array_equal(sample, stream[j * SEQ_LEN : j * SEQ_LEN + SEQ_LEN + 1])
    with pytest.raises(IndexError):
        dataset.sample(dataset.num_samples)


def test_shards_are_memory_mapped_not_loaded(corpus):
    dataset = TokenDataset(corpus[0], SEQ_LEN)
    assert all(isinstance(shard.tokens, np.memmap) for shard in dataset.shards if shard.num_tokens)


def test_shuffle_covers_each_sample_exactly_once_per_epoch(corpus):
    dataset = TokenDataset(corpus[0], SEQ_LEN, seed=3)
    n = dataset.num_samples
    for epoch in range(3):
        order = dataset.permutation(epoch)
        assert sorted(order.tolist()) == list(range(n))
        batch = dataset.take(n)
        rows = {tuple(r) for r in batch.tolist()}
        assert rows == {tuple(dataset.sample(j).tolist()) for j in range(n)}
        assert dataset.epoch == epoch + 1
    assert not np.array_equal(dataset.permutation(0), dataset.permutation(1))
    other_seed = TokenDataset(corpus[0], SEQ_LEN, seed=4)
    assert not np.array_equal(dataset.permutation(0), other_seed.permutation(0))


def test_take_rank_slices_tile_the_global_batch(corpus):
    world_size, global_batch = 2, 4
    single = TokenDataset(corpus[0], SEQ_LEN, seed=7)
    ranks = [TokenDataset(corpus[0], SEQ_LEN, seed=7) for _ in range(world_size)]
    for _ in range(5):  # 20 samples: crosses into the second epoch (10 per epoch)
        full = single.take(global_batch)
        parts = [d.take(global_batch, rank=r, world_size=world_size) for r, d in enumerate(ranks)]
        assert all(p.shape == (global_batch // world_size, SEQ_LEN + 1) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), full)
    assert all(d.consumed_samples == single.consumed_samples == 20 for d in ranks)


def test_repeat_continues_into_the_next_epochs_permutation_mid_batch(corpus):
    dataset = TokenDataset(corpus[0], SEQ_LEN, seed=5)
    n = dataset.num_samples
    dataset.take(n - 2)
    batch = dataset.take(4)
    expected = [
        dataset.permutation(0)[n - 2],
        dataset.permutation(0)[n - 1],
        dataset.permutation(1)[0],
        dataset.permutation(1)[1],
    ]
    np.testing.assert_array_equal(batch, np.stack([dataset.sample(int(j)) for j in expected]))
    assert dataset.epoch == 1


def test_take_resumes_exactly_from_state(corpus):
    uninterrupted = TokenDataset(corpus[0], SEQ_LEN, seed=11)
    batches = [uninterrupted.take(6, rank=1, world_size=2) for _ in range(7)]

    first = TokenDataset(corpus[0], SEQ_LEN, seed=11)
    for _ in range(3):
        first.take(6, rank=1, world_size=2)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    assert state == {
        "version": 2,
        "consumed_samples": 18,
        "seed": 11,
        "seq_len": SEQ_LEN,
        "on_exhausted": "repeat",
        "epoch": 1,
        "corpora": [
            {"num_samples": 10, "num_tokens": 82, "weight": 1.0, "consumed_samples": 18, "epoch": 1}
        ],
    }

    resumed = TokenDataset(corpus[0], SEQ_LEN, seed=999)  # the state's seed wins
    resumed.load_state_dict(state)
    for expected in batches[3:]:
        np.testing.assert_array_equal(resumed.take(6, rank=1, world_size=2), expected)


def test_stop_raises_data_exhausted_before_consuming(corpus):
    dataset = TokenDataset(corpus[0], SEQ_LEN, on_exhausted="stop")
    dataset.take(8)
    assert not dataset.can_take(4) and dataset.can_take(2)  # it consumes nothing
    with pytest.raises(DataExhausted, match="2 of 10 samples left.*needs 4"):
        dataset.take(4)
    assert dataset.consumed_samples == 8
    assert dataset.take(2).shape == (2, SEQ_LEN + 1)
    assert not dataset.can_take(1) and TokenDataset(corpus[0], SEQ_LEN).can_take(100)
    with pytest.raises(DataExhausted):
        dataset.take(1)


def test_take_rejects_a_world_size_that_does_not_divide_the_batch(corpus):
    dataset = TokenDataset(corpus[0], SEQ_LEN)
    with pytest.raises(ValueError, match=r"world_size \(3\) must divide global_batch_size \(4\)"):
        dataset.take(4, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        dataset.take(4, rank=2, world_size=2)
    assert dataset.consumed_samples == 0


def test_load_state_dict_rejects_another_seq_len_corpus_or_version(corpus):
    state = TokenDataset(corpus[0], SEQ_LEN).state_dict()
    with pytest.raises(ValueError, match="resume with seq_len=8"):
        TokenDataset(corpus[0], 4).load_state_dict(state)
    changed = {**state, "corpora": [{**state["corpora"][0], "num_samples": 11}]}
    with pytest.raises(ValueError, match="the corpus changed"):
        TokenDataset(corpus[0], SEQ_LEN).load_state_dict(changed)
    with pytest.raises(ValueError, match="version"):
        TokenDataset(corpus[0], SEQ_LEN).load_state_dict({"consumed_samples": 0, "seed": 0})
    dataset = TokenDataset(corpus[0], SEQ_LEN, seed=4)
    for seed in (-1, 1.5, None):  # -1 was taken, and take() then failed inside numpy
        with pytest.raises(ValueError, match=r"the data loader state's seed \(.*\) must be an"):
            dataset.load_state_dict({**state, "seed": seed})
    assert dataset.seed == 4


@pytest.mark.parametrize(
    "drop, named",
    [("seq_len", "['seq_len']"), ("seed", "['seed']"), ("corpus_weight", "['corpora[0].weight']")],
)
def test_load_state_dict_without_a_key_names_it_and_the_fix(corpus, drop, named):
    state = TokenDataset(corpus[0], SEQ_LEN).state_dict()
    if drop == "corpus_weight":
        state["corpora"] = [{k: v for k, v in state["corpora"][0].items() if k != "weight"}]
    else:
        del state[drop]
    with pytest.raises(ValueError) as err:
        TokenDataset(corpus[0], SEQ_LEN).load_state_dict(state)
    assert f"data loader state lacks {named}" in str(err.value)
    assert "this dataset's state_dict() returned" in str(err.value)


def test_directory_without_shards_or_tokens_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} holds no shards"):
        TokenDataset(tmp_path, 8)
    (tmp_path / "leftover.idx.tmp").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no shards"):
        TokenDataset(tmp_path, 8)
    with IndexedDatasetWriter(tmp_path / "tiny", np.uint16) as writer:
        writer.add_document([1, 2, 0])
    with pytest.raises(ValueError, match="too few for one sample"):
        TokenDataset(tmp_path, 8)


def test_a_shard_without_its_bin_is_a_value_error_naming_it(corpus):
    data_dir, _ = corpus
    (data_dir / "c.bin").unlink()  # say an interrupted copy of the corpus
    for path in (data_dir, data_dir / "c"):  # was FileNotFoundError, a trainer traceback
        with pytest.raises(ValueError, match=r"c.idx has no c.bin beside it"):
            TokenDataset(path, SEQ_LEN)


def test_vocab_size_and_eos_come_from_the_manifest(corpus):
    data_dir, _ = corpus
    assert TokenDataset(data_dir, SEQ_LEN).vocab_size is None
    (data_dir / "manifest.json").write_text(json.dumps({"vocab_size": 60001, "eos_id": 0}))
    dataset = TokenDataset(data_dir, SEQ_LEN)
    assert (dataset.vocab_size, dataset.eos_id) == (60001, 0)
    manifest = {"vocab_size": 60001, "eos_id": 0, "shards": [{"name": "a"}, {"name": "c"}]}
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning) as warned:  # shard b is not listed: said once, not twice
        dataset = TokenDataset(data_dir, SEQ_LEN)
    assert len(warned) == 1 and "shards ['b'] are not in its" in str(warned[0].message)
    assert (dataset.vocab_size, dataset.eos_id) == (60001, 0)


def test_shards_whose_sequences_are_not_back_to_back_are_refused(corpus, monkeypatch):
    import mt_data.corpus

    data_dir, _ = corpus
    monkeypatch.setattr(mt_data.corpus, "_CHECK_CHUNK", 2)  # the check spans several chunks
    assert TokenDataset(data_dir, SEQ_LEN).num_tokens == 82
    idx = data_dir / "c.idx"
    raw = bytearray(idx.read_bytes())
    pointers_at = 34 + 4 * 5  # after the header and the 5 lengths of shard c
    raw[pointers_at + 8 * 3 : pointers_at + 8 * 4] = (10**6).to_bytes(8, "little")
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not stored back to back"):
        TokenDataset(data_dir, SEQ_LEN)


def test_a_shard_that_disagrees_with_the_manifest_is_refused_naming_it(tmp_path):
    from mt_data import build_corpus
    from mt_data.default_corpus import default_tokenizer_path

    corpora = {}
    for name, texts in (("old", ["def f(x):\n    return x\n"] * 3), ("new", ["print(1)"] * 9)):
        (tmp_path / name).mkdir()
        source = tmp_path / name / "x.jsonl"  # one stem: both build a shard named x
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        corpora[name] = tmp_path / f"{name}-corpus"
        build_corpus([source], default_tokenizer_path(), corpora[name], workers=0, progress=False)
    for suffix in (".bin", ".idx"):  # say the shard of another build copied in by hand
        (corpora["old"] / f"x{suffix}").write_bytes((corpora["new"] / f"x{suffix}").read_bytes())
    with pytest.raises(ValueError) as err:
        TokenDataset(corpora["old"], 4)
    message = str(err.value)
    assert f"{corpora['old'] / 'x.idx'} holds 9 documents" in message
    assert f"{corpora['old'] / 'manifest.json'} lists 3 documents" in message
    assert "rebuild the corpus" in message
    assert TokenDataset(corpora["new"], 4).num_samples > 0


def test_a_corpus_directory_s_manifest_is_read_once_to_list_and_check_its_shards(
    corpus, monkeypatch
):
    # The shard counts were checked against a second read of the manifest the shard
    # listing had just read.
    import mt_data.corpus
    from mt_data.corpus import PackedCorpus

    data_dir, _ = corpus
    shards = [{"name": "a", "documents": 3}, {"name": "b", "documents": 0}, {"name": "c"}]
    (data_dir / "manifest.json").write_text(json.dumps({"shards": shards}))
    reads = []
    read_manifest = mt_data.corpus.read_manifest

    def counting_read_manifest(directory):
        reads.append(directory)
        return read_manifest(directory)

    monkeypatch.setattr(mt_data.corpus, "read_manifest", counting_read_manifest)
    assert [s.idx_path.stem for s in PackedCorpus([data_dir], SEQ_LEN).shards] == ["a", "b", "c"]
    assert reads == [data_dir]
    # A shard prefix's directory was listed by no manifest read: its counts are still checked.
    shards[0]["documents"] = 4
    (data_dir / "manifest.json").write_text(json.dumps({"shards": shards}))
    with pytest.raises(ValueError, match="lists 4 documents"):
        PackedCorpus([data_dir / "a"], SEQ_LEN)


def test_a_state_of_a_corpus_rebuilt_since_with_as_many_samples_is_refused(corpus):
    data_dir, stream = corpus
    dataset = TokenDataset(data_dir, SEQ_LEN, seed=2)
    dataset.take(3)
    state = json.loads(json.dumps(dataset.state_dict()))
    with IndexedDatasetWriter(data_dir / "c", np.uint16) as writer:  # one document more
        for tokens in (*np.split(stream[22:], np.cumsum([4, 31, 3, 10])), [7, 7, 0]):
            writer.add_document(tokens)
    rebuilt = TokenDataset(data_dir, SEQ_LEN)
    assert rebuilt.num_tokens == len(stream) + 3
    assert rebuilt.num_samples == dataset.num_samples  # the sample count alone cannot tell
    with pytest.raises(ValueError, match=r"num_tokens 82 .* now holds 85: the corpus changed"):
        rebuilt.load_state_dict(state)
    assert rebuilt.consumed_samples == 0
    saved = state["corpora"][0]
    older = {**state, "corpora": [{k: v for k, v in saved.items() if k != "num_tokens"}]}
    rebuilt.load_state_dict(older)  # a state saved before num_tokens was kept still loads
    assert rebuilt.consumed_samples == 3


def test_putting_the_loader_back_keeps_its_shuffle_and_a_new_seed_replaces_it(corpus, monkeypatch):
    from mt_data.shuffle import IndexPermutation

    evaluated = []
    original = IndexPermutation.__call__
    monkeypatch.setattr(
        IndexPermutation, "__call__", lambda self, p: evaluated.append(1) or original(self, p)
    )
    dataset = TokenDataset(corpus[0], SEQ_LEN, seed=6)
    dataset.take(2)
    before = len(evaluated)
    for _ in range(3):  # mt-train's look-ahead: take, then put the position back
        position = dataset.state_dict()
        looked = dataset.take(2, token_ranges=[(0, 1)])
        dataset.load_state_dict(position)
        np.testing.assert_array_equal(dataset.take(2)[:, :1], looked)
    assert len(evaluated) == before  # the order was computed once (it took ~2 ms a step)
    reseeded = {**dataset.state_dict(), "seed": 7}
    dataset.load_state_dict(reseeded)
    fresh = TokenDataset(corpus[0], SEQ_LEN, seed=7)
    fresh.load_state_dict(reseeded)
    np.testing.assert_array_equal(dataset.take(4), fresh.take(4))


def test_a_hand_written_manifest_is_checked_by_the_names_it_is_read_by(corpus):
    data_dir, _ = corpus
    (data_dir / "b.idx").unlink()  # shards a and c remain
    (data_dir / "b.bin").unlink()
    (data_dir / "c.idx").rename(data_dir / "7.idx")  # a name JSON may hold as a number
    (data_dir / "c.bin").rename(data_dir / "7.bin")
    shards = [{"name": "a", "tokens": 22}, {"name": 7, "tokens": 60}]
    (data_dir / "manifest.json").write_text(json.dumps({"shards": shards}))
    assert TokenDataset(data_dir, SEQ_LEN).num_tokens == 82
    shards[1]["tokens"] = 59
    (data_dir / "manifest.json").write_text(json.dumps({"shards": shards}))
    with pytest.raises(ValueError, match=r"7\.idx holds 5 documents and 60 uint16 tokens"):
        TokenDataset(data_dir, SEQ_LEN)


def test_a_shard_with_a_negative_sequence_length_is_refused_naming_it(tmp_path):
    import struct

    # A corrupt index (or a writer that wrapped a length past 2**31 into int32) whose
    # pointers agree with its lengths looked back to back, with a token count that was off.
    lengths = np.array([30, -5, 5], dtype="<i4")
    pointers = 2 * (np.cumsum(lengths.astype(np.int64)) - lengths)
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 3, 4)
    (tmp_path / "s.idx").write_bytes(
        header + lengths.tobytes() + pointers.astype("<i8").tobytes()
        + np.arange(4, dtype="<i8").tobytes()
    )  # fmt: skip
    (tmp_path / "s.bin").write_bytes(np.arange(30, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"s\.idx: sequence 1 has length -5"):
        TokenDataset(tmp_path, 4)
