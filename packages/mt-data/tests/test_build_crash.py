"""What a killed, refused or out-of-space build leaves behind, what the next build does
with it, and two builds into one directory at once."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt_data import build_corpus
from mt_data.build import build_lock
from mt_data.default_corpus import default_tokenizer_path, iter_default_documents

# The names an interrupted build can leave: a shard's temporaries, a build record's and
# the manifest's (of a shard `gone` whose input the rerun no longer has).
PARTIAL_FILES = ("gone.bin.tmp", "gone.idx.tmp", ".mt-data/gone.json.tmp", "manifest.json.tmp")


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _build(inputs, output, **kwargs):
    kwargs.setdefault("workers", 0)
    return build_corpus(inputs, default_tokenizer_path(), output, progress=False, **kwargs)


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _leave_partial_files(out: Path) -> None:
    for name in PARTIAL_FILES:
        (out / name).write_bytes(b"half-written")


def test_a_rerun_removes_the_partial_files_of_a_crashed_build_and_nothing_finished(tmp_path):
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["def f(): pass", "x = 1"])
    b = _write_jsonl(tmp_path / "in" / "b.jsonl", ["y = 2"])
    out = tmp_path / "out"
    _build([a, b], out)
    finished = _files(out)
    _leave_partial_files(out)
    (out / "notes.tmp").write_text("not written by mt-data")  # no name a build writes
    summary = _build([a, b], out)
    assert summary.num_resumed == 2
    assert _files(out) == {**finished, "notes.tmp": b"not written by mt-data"}


def test_partial_files_are_left_to_a_build_that_holds_the_lock(tmp_path):
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1"])
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mt-data").mkdir()
    _leave_partial_files(out)
    with (
        build_lock(out),  # another build is writing these files right now
        pytest.raises(ValueError, match="another mt-data build is writing"),
    ):
        _build([a], out)
    assert all((out / name).read_bytes() == b"half-written" for name in PARTIAL_FILES)


def test_a_refused_build_leaves_the_partial_files_too(tmp_path):
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1"])
    out = tmp_path / "out"
    _build([a], out)
    _leave_partial_files(out)
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_bytes(default_tokenizer_path().read_bytes() + b"\n")
    with pytest.raises(ValueError, match="choose a new output directory"):
        build_corpus([a], other, out, workers=0, progress=False)
    assert all((out / name).read_bytes() == b"half-written" for name in PARTIAL_FILES)


def _without_flock(monkeypatch, error=None) -> None:
    """Make `flock` fail as on a file system without it (NFS): builds go ahead unlocked."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise error or OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", no_flock)


def _second_writes_while_the_first_finalizes(monkeypatch, second, second_is_writing,
                                             first_is_done):  # fmt: skip
    """Interleaves two builds of one shard: the first (this thread) starts `second` as it
    finalizes and waits until `second` has written a batch; `second` then waits for
    `first_is_done`."""
    import threading

    from mt_data.indexed import IndexedDatasetWriter

    add_documents, finalize = IndexedDatasetWriter.add_documents, IndexedDatasetWriter.finalize

    def paused_add_documents(self, tokens, lengths):
        add_documents(self, tokens, lengths)
        if threading.current_thread() is second and not second_is_writing.is_set():
            second_is_writing.set()
            first_is_done.wait(30)

    def finalize_while_the_second_writes(self):
        if threading.current_thread() is not second:
            second.start()
            assert second_is_writing.wait(30)
        finalize(self)

    monkeypatch.setattr(IndexedDatasetWriter, "add_documents", paused_add_documents)
    monkeypatch.setattr(IndexedDatasetWriter, "finalize", finalize_while_the_second_writes)


def _second_build(inputs, output):
    """A build into `output` on another thread (as another process would run it); returns
    the unstarted thread and the list its exception, if any, lands in."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            _build(inputs, output)
        except BaseException as e:  # reported by the test
            errors.append(e)

    return threading.Thread(target=run), errors


def _first_build(inputs, output, first_is_done, second) -> None:
    """Runs the first of two unlocked builds into `output`, then lets the second (waiting
    on `first_is_done`) finish."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot lock the directory", from both builds
        try:
            _build(inputs, output)
        finally:
            first_is_done.set()
            second.join(30)


def test_without_a_lock_only_partial_files_untouched_for_an_hour_are_removed(tmp_path, monkeypatch):
    import errno

    _without_flock(monkeypatch, OSError(errno.ENOLCK, "No locks available"))
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1"])
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mt-data").mkdir()
    _leave_partial_files(out)  # just written: another build may be writing them
    # What unlocked builds (temporaries of their own) killed long ago left.
    old = ["old.bin.4242-0a1b2c3d.tmp", "old.idx.4242-0a1b2c3d.tmp", "old.bin.tmp",
           ".mt-data/old.json.4242-0a1b2c3d.tmp", "manifest.json.4242-0a1b2c3d.tmp"]  # fmt: skip
    then = time.time() - 2 * 3600
    for name in old:
        (out / name).write_bytes(b"half-written")
        os.utime(out / name, (then, then))
    with pytest.warns(UserWarning, match="cannot lock the directory"):
        _build([a], out)
    assert all((out / name).read_bytes() == b"half-written" for name in PARTIAL_FILES)
    assert not any((out / name).exists() for name in old)


def test_a_build_killed_mid_shard_leaves_no_partial_file_after_the_next_build(tmp_path):
    texts: list[str] = []
    for source in iter_default_documents():
        texts.append(source)
        if sum(map(len, texts)) > 2_000_000:
            break
    big = _write_jsonl(tmp_path / "in" / "big.jsonl", texts)
    small = _write_jsonl(tmp_path / "in" / "small.jsonl", ["x = 1"])
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "mt_data", "build", str(big), "--output", str(out),
        "--tokenizer", str(default_tokenizer_path()), "--workers", "0", "--no-progress",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        if (out / "big.bin.tmp").is_file() and (out / "big.bin.tmp").stat().st_size > 0:
            break
        time.sleep(0.005)
    assert process.poll() is None, "the build finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)  # no clean-up at all
    process.wait()
    assert (out / "big.bin.tmp").is_file()
    assert not (out / "big.idx").exists() and not (out / "manifest.json").exists()
    _build([small], out)  # the big input is dropped from the build
    assert sorted(_files(out)) == [".mt-data/small.json", "manifest.json", "small.bin", "small.idx"]


def _limit_file_size() -> None:  # in the child: writes past 100 kB fail as a full disk does
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a kill


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_cli_build_out_of_space_names_the_file_and_says_to_rerun(tmp_path):
    texts = [t for _, t in zip(range(40), iter_default_documents(), strict=False)]
    data = _write_jsonl(tmp_path / "in" / "a.jsonl", texts)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "mt_data", "build", str(data), "--output", str(out),
        "--tokenizer", str(default_tokenizer_path()), "--workers", "0", "--no-progress",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=_limit_file_size)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(out / "a.bin.tmp") in result.stderr
    assert "rerun the same command" in result.stderr
    assert not list(out.glob("*.tmp"))


def test_readers_call_a_first_build_killed_before_any_shard_unfinished(tmp_path):
    from mt_data import TokenDataset

    out = tmp_path / "out"
    out.mkdir()
    (out / "a.bin.tmp").write_bytes(b"\0" * 64)  # all a killed first build left
    (out / "a.idx.tmp").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"no shards.*has not finished \(a.idx.tmp\).*rerun"):
        TokenDataset(out, seq_len=4)
    (out / "a.idx.tmp").rename(out / "a.idx.4242-0a1b2c3d.tmp")  # a build without flock's
    with pytest.raises(ValueError, match=r"has not finished \(a.idx.4242-0a1b2c3d.tmp\)"):
        TokenDataset(out, seq_len=4)


def test_parquet_inputs_without_pyarrow_are_refused_before_any_shard_is_built(
    tmp_path, monkeypatch
):
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1"])
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"b.parquet.*needs pyarrow.*mt-data\[parquet\]"):
        _build([a, tmp_path / "in" / "b.parquet"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_two_builds_without_a_lock_never_leave_a_wrong_shard(tmp_path, monkeypatch):
    import threading

    import mt_data.sources as sources

    monkeypatch.setattr(sources, "BATCH_BYTES", 4096)  # many batches in one shard
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", [f"x{i} = {i} * 2" * 20 for i in range(300)])
    _build([a], tmp_path / "reference")
    expected = _files(tmp_path / "reference")

    _without_flock(monkeypatch)  # every build goes ahead unlocked, with a warning
    # Build 1 (this thread) is about to finish its shard when build 2 (another thread, as
    # another process would) starts the same one; build 2 waits half-way until build 1 is done.
    second_is_writing, first_is_done = threading.Event(), threading.Event()
    second, errors = _second_build([a], tmp_path / "out")
    _second_writes_while_the_first_finalizes(monkeypatch, second, second_is_writing, first_is_done)
    _first_build([a], tmp_path / "out", first_is_done, second)
    files = _files(tmp_path / "out")
    assert {name: files.get(name) for name in ("a.bin", "a.idx")} == {
        name: expected[name] for name in ("a.bin", "a.idx")
    }
    assert not errors, errors
    assert {name: files[name] for name in expected} == expected


def test_two_builds_without_a_lock_writing_the_manifest_at_once_both_succeed(tmp_path, monkeypatch):
    import threading

    import mt_data.manifest as manifest_module

    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1", "y = 2"])
    _build([a], tmp_path / "reference")
    expected = _files(tmp_path / "reference")

    _without_flock(monkeypatch)
    # Build 1 has opened its manifest's temporary file when build 2 opens its own; build
    # 2 writes it once build 1 is done.
    second_opened, first_is_done = threading.Event(), threading.Event()
    second, errors = _second_build([a], tmp_path / "out")
    dump = json.dump

    def paused_dump(data, f, **kwargs):
        if "shards" in data:  # the manifest, not a build record
            if threading.current_thread() is second:
                second_opened.set()
                first_is_done.wait(30)
            else:
                second.start()
                assert second_opened.wait(30)
        dump(data, f, **kwargs)

    monkeypatch.setattr(manifest_module.json, "dump", paused_dump)
    _first_build([a], tmp_path / "out", first_is_done, second)
    assert not errors, errors
    assert _files(tmp_path / "out") == expected


def test_a_file_system_that_cannot_fsync_a_directory_still_builds(tmp_path, monkeypatch):
    import errno
    import stat

    import mt_data.indexed as indexed

    fsync = os.fsync

    def fsync_refusing_directories(fd):  # some FUSE and network file systems
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(indexed.os, "fsync", fsync_refusing_directories)
    a = _write_jsonl(tmp_path / "in" / "a.jsonl", ["x = 1"])
    summary = _build([a], tmp_path / "out")
    assert summary.num_documents == 1 and (tmp_path / "out" / "manifest.json").is_file()


def test_a_running_unlocked_build_keeps_its_temporaries_out_of_the_stale_clean_up(
    tmp_path, monkeypatch
):
    # A build without flock removes others' temporaries untouched for an hour. A writer's
    # batches sat in its files' buffers (st_blksize: 1-4 MiB on NFS and Lustre, a million
    # document lengths in the .idx), so a shard being written could look an hour old and
    # lose its .idx.<pid>-<random>.tmp to a second build; the first then failed to rename it.
    import numpy as np

    import mt_data.indexed as indexed
    from mt_data.build import remove_partial_files
    from mt_data.indexed import IndexedDataset, IndexedDatasetWriter

    clock = [1000.0]
    monkeypatch.setattr(indexed.time, "monotonic", lambda: clock[0])

    suffix = ".4242-0a1b2c3d.tmp"
    writer = IndexedDatasetWriter(tmp_path / "a", np.uint16, temp_suffix=suffix)
    writer.add_documents(np.array([5, 6, 7], np.uint16), np.array([2, 1]))
    temporaries = [tmp_path / f"a.bin{suffix}", tmp_path / f"a.idx{suffix}"]
    then = time.time() - 2 * 3600  # as if the first batch was written two hours ago
    for path in temporaries:
        os.utime(path, (then, then))
    clock[0] += 61  # the batch written a minute later, now
    writer.add_documents(np.array([8], np.uint16), np.array([1]))
    assert remove_partial_files(tmp_path, older_than=3600) == []
    writer.finalize()
    shard = IndexedDataset(tmp_path / "a")
    assert [shard[i].tolist() for i in range(len(shard))] == [[5, 6], [7], [8]]


def test_two_default_builds_without_a_lock_never_leave_a_torn_shard(tmp_path, monkeypatch):
    # `mt-data build-default --output DIR` without flock (NFS) wrote stdlib.bin.tmp and
    # stdlib.idx.tmp whatever ran beside it: a second build truncated the first's files,
    # the first renamed a torn shard into place and the second failed at its rename.
    import threading
    import warnings

    import mt_data.default_corpus as default_corpus

    documents = [f"x{i} = {i} * 2" * 20 for i in range(600)]  # three batches
    monkeypatch.setattr(default_corpus, "iter_default_documents", lambda: iter(documents))
    default_corpus.build_default_corpus(tmp_path / "reference")
    expected = _files(tmp_path / "reference")

    _without_flock(monkeypatch)
    out = tmp_path / "out"
    second_is_writing, first_is_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run_second() -> None:
        try:
            default_corpus.build_default_corpus(out)
        except BaseException as e:  # reported by the test
            errors.append(e)

    second = threading.Thread(target=run_second)
    _second_writes_while_the_first_finalizes(monkeypatch, second, second_is_writing, first_is_done)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot lock the directory", from both builds
        try:
            default_corpus.build_default_corpus(out)
            first = _files(out)
        finally:
            first_is_done.set()
            second.join(30)
    shard = ("stdlib.bin", "stdlib.idx")
    assert {name: first.get(name) for name in shard} == {name: expected[name] for name in shard}
    assert not errors, errors
    assert _files(out) == expected


def test_a_default_build_without_a_lock_removes_only_old_unlocked_temporaries(
    tmp_path, monkeypatch
):
    import mt_data.default_corpus as default_corpus

    monkeypatch.setattr(default_corpus, "iter_default_documents", lambda: iter(["x = 1"]))
    _without_flock(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    old, recent = "stdlib.idx.4242-0a1b2c3d.tmp", "stdlib.bin.4243-0a1b2c3d.tmp"
    for name in (old, recent):
        (out / name).write_bytes(b"half-written")
    then = time.time() - 2 * 3600  # a killed build's; the recent one may be running
    os.utime(out / old, (then, then))
    with pytest.warns(UserWarning, match="cannot lock the directory"):
        default_corpus.build_default_corpus(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "stdlib.bin", recent, "stdlib.idx"
    ]  # fmt: skip
