"""Megatron indexed format: header bytes, round trip, dtype choice, crash safety."""

from __future__ import annotations

import gc
import os
import resource
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mt_data import IndexedDataset, IndexedDatasetWriter, token_dtype


def test_token_dtype_is_uint16_below_65500_and_int32_from_it():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(151_936) == np.int32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_writer_output_has_megatron_header_and_document_index_starting_at_zero(tmp_path):
    docs = [[5, 6, 7], [], [65535, 0]]
    with IndexedDatasetWriter(tmp_path / "shard", np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    idx = (tmp_path / "shard.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, num_sequences, num_doc_indices = struct.unpack("<QBQQ", idx[9:34])
    assert (version, code, num_sequences, num_doc_indices) == (1, 8, 3, 4)
    lengths = np.frombuffer(idx, np.int32, 3, offset=34)
    pointers = np.frombuffer(idx, np.int64, 3, offset=34 + 12)
    doc_idx = np.frombuffer(idx, np.int64, 4, offset=34 + 36)
    assert lengths.tolist() == [3, 0, 2]
    assert pointers.tolist() == [0, 6, 6]  # bytes, uint16
    assert doc_idx.tolist() == [0, 1, 2, 3]
    assert len(idx) == 34 + 36 + 32
    assert (tmp_path / "shard.bin").read_bytes() == np.array([5, 6, 7, 65535, 0], "<u2").tobytes()


@pytest.mark.parametrize("vocab_size", [4096, 200_000])
def test_reader_returns_what_the_writer_wrote(tmp_path, vocab_size):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=n) for n in (1, 17, 0, 300)]
    with IndexedDatasetWriter(tmp_path / "s", token_dtype(vocab_size)) as writer:
        for doc in docs:
            writer.add_document(doc)
    dataset = IndexedDataset(tmp_path / "s")
    assert dataset.dtype == token_dtype(vocab_size)
    assert len(dataset) == 4
    assert dataset.num_tokens == 318
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert dataset.sequence_lengths.tolist() == [1, 17, 0, 300]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(dataset[i], doc)
    np.testing.assert_array_equal(dataset[-1], docs[-1])
    with pytest.raises(IndexError):
        dataset[4]


def test_writer_deletes_temporaries_when_an_exception_escapes(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "s", np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("crash mid-shard")
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_cannot_open_its_index_leaves_no_temporaries(tmp_path, monkeypatch):
    import builtins

    import mt_data.indexed as indexed

    def open_failing_for_the_index(file, *args, **kwargs):
        if str(file).endswith(".idx.tmp"):
            raise OSError(24, "Too many open files", str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(indexed, "open", open_failing_for_the_index, raising=False)
    with pytest.raises(OSError, match="Too many open files"):
        IndexedDatasetWriter(tmp_path / "s", np.uint16)
    assert list(tmp_path.iterdir()) == []


def test_unfinished_writer_leaves_only_tmp_files(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "s", np.uint16)
    writer.add_document([1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin.tmp", "s.idx.tmp"]
    writer.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_disk_full_while_writing_leaves_no_temporaries_and_names_the_file(tmp_path):
    # Small documents stay in the file's buffer: the write that fails is a flush, and
    # closing the file on the way out tries (and fails) to flush them again.
    script = textwrap.dedent(
        """
        import resource, signal, sys
        import numpy as np
        from mt_data import IndexedDatasetWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), as ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        try:
            with IndexedDatasetWriter(sys.argv[1], np.uint16) as writer:
                for _ in range(1000):
                    writer.add_document(np.arange(100))
        except OSError as e:
            print(e)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[Errno 27] File too large: '{tmp_path / 's.bin.tmp'}'"
    assert list(tmp_path.iterdir()) == []


def test_a_crash_between_the_renames_of_a_replaced_shard_leaves_no_shard_not_a_torn_one(
    tmp_path, monkeypatch
):
    import mt_data.indexed as indexed

    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        writer.add_documents(np.arange(6), np.array([3, 3]))
    replace = os.replace

    def crash_before_the_index(src, dst):
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt  # the new .bin is in place, the new .idx is not
        replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", crash_before_the_index)
    with pytest.raises(KeyboardInterrupt), IndexedDatasetWriter(tmp_path / "s", np.uint16) as w:
        w.add_documents(np.arange(10, 16), np.array([2, 4]))  # same size, other lengths
    with pytest.raises(FileNotFoundError, match="s.idx"):
        IndexedDataset(tmp_path / "s")


def test_writer_rejects_token_ids_that_do_not_fit_the_dtype(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        with pytest.raises(ValueError, match="do not fit uint16"):
            writer.add_document([1, 70_000])
        with pytest.raises(ValueError, match="must be integers, got float64"):
            writer.add_document([1.5, 2.0])  # was stored as [1, 2]
        writer.add_document([1])
        writer.add_document([])  # an empty list is float64 to numpy, and fine
    assert [d.tolist() for d in IndexedDataset(tmp_path / "s")] == [[1], []]
    with pytest.raises(ValueError, match="no code in Megatron"):
        IndexedDatasetWriter(tmp_path / "t", np.uint32)


def _write(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        writer.add_document([1, 2, 3, 4])
    return tmp_path / "s.idx", tmp_path / "s.bin"


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda idx, b: idx.write_bytes(b"NOTMEGA!!" + idx.read_bytes()[9:]), "magic"),
        (
            lambda idx, b: idx.write_bytes(
                idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]
            ),
            "version 2",
        ),
        (lambda idx, b: idx.write_bytes(idx.read_bytes()[:-8]), "truncated"),
        (lambda idx, b: idx.write_bytes(idx.read_bytes()[:20]), "truncated"),
        (lambda idx, b: b.write_bytes(b.read_bytes()[:-2]), "truncated"),
    ],
    ids=["magic", "version", "idx-short", "header-short", "bin-short"],
)
def test_reader_error_names_the_file_and_the_problem(tmp_path, corrupt, message):
    idx, bin_ = _write(tmp_path)
    corrupt(idx, bin_)
    with pytest.raises(ValueError, match=message) as excinfo:
        IndexedDataset(tmp_path / "s")
    assert str(tmp_path / "s.") in str(excinfo.value)


def test_a_shard_holds_two_file_descriptors_and_running_out_is_a_clear_error(tmp_path):
    resource = pytest.importorskip("resource")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counts open files in /proc/self/fd (Linux)")
    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        writer.add_document([1, 2, 3])

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()  # no earlier test's maps closed while counting
    gc.disable()
    try:
        before = open_descriptors()
        shards = [IndexedDataset(tmp_path / "s") for _ in range(3)]
        assert open_descriptors() - before == 2 * len(shards)  # was 4: 256 used up 1024
    finally:
        gc.enable()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_descriptors() + 3, hard))
    try:
        with pytest.raises(ValueError, match=r"s\.(idx|bin): too many open files .*raise the"):
            shards += [IndexedDataset(tmp_path / "s") for _ in range(3)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("document_indices", "named"),
    [([], "no document index"), ([1, 2], "starts at 1"), ([0, 3], "ends at 3")],
)
def test_an_index_whose_document_index_is_impossible_is_refused_naming_it(
    tmp_path, document_indices, named
):
    idx, _ = _write(tmp_path)  # one sequence: its document index is [0, 1]
    raw = idx.read_bytes()
    header = raw[:26] + struct.pack("<Q", len(document_indices))
    body = raw[34 : 34 + 12] + struct.pack(f"<{len(document_indices)}q", *document_indices)
    idx.write_bytes(header + body)  # the sizes agree: only the values are wrong
    with pytest.raises(ValueError, match=rf"s\.idx: .*{named}.*rebuild the shard"):
        IndexedDataset(tmp_path / "s")
