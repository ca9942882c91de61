"""The embedded default corpus and tokenizer: offline, cached, never half-built."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

import mt_data.default_corpus as default_corpus
from mt_data import IndexedDataset, TokenDataset, default_corpus_dir, default_tokenizer_path
from mt_data.build import build_lock
from mt_data.cli import main


def test_default_tokenizer_round_trips_any_text_and_has_the_eos(tokenizer):
    assert default_tokenizer_path().is_file()
    assert default_tokenizer_path().stat().st_size < 400_000
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_id == tokenizer.tokenizer.token_to_id("<|endoftext|>")
    for text in ["def f(x):\n\treturn x  # ok\r\n", "héllo wörld 🎉 日本語", "\x00\x7f", " lead"]:
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.tokenizer.decode(ids) == text
    code = "import os\n\n\ndef main():\n    return os.getcwd()\n"
    assert len(tokenizer.tokenizer.encode(code).ids) < len(code) / 2  # it learned Python


def test_default_documents_are_sorted_stdlib_sources_without_excluded_directories():
    paths = default_corpus.default_document_paths()
    root = default_corpus._stdlib_root()
    relative = [p.relative_to(root).as_posix() for p in paths]
    assert relative == sorted(relative)
    assert "os.py" in relative and "json/decoder.py" in relative
    for excluded in default_corpus.EXCLUDED_DIRECTORIES:
        assert not any(excluded in p.relative_to(root).parts for p in paths)
    first = next(default_corpus.iter_default_documents())
    assert first == paths[0].read_text(encoding="utf-8")


@pytest.mark.slow
def test_default_corpus_builds_once_into_the_cache_and_token_dataset_reads_it(tmp_path, tokenizer):
    corpus = default_corpus_dir(tmp_path)
    assert corpus.parent == tmp_path / "corpus"
    assert corpus.name.startswith("stdlib-py3.")
    assert sorted(p.name for p in corpus.iterdir()) == ["manifest.json", "stdlib.bin", "stdlib.idx"]
    assert [p.name for p in (tmp_path / "corpus").iterdir()] == [corpus.name]  # no temp dirs
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["num_documents"] > 400 and manifest["vocab_size"] == 4096

    mtime = (corpus / "manifest.json").stat().st_mtime_ns
    assert default_corpus_dir(tmp_path) == corpus  # cached: not rebuilt
    assert (corpus / "manifest.json").stat().st_mtime_ns == mtime

    shard = IndexedDataset(corpus / "stdlib")
    first_text = next(default_corpus.iter_default_documents())
    assert tokenizer.tokenizer.decode(shard[0][:-1].tolist()) == first_text
    dataset = TokenDataset(corpus, 256, seed=0)
    assert (dataset.vocab_size, dataset.eos_id) == (4096, tokenizer.eos_id)
    batch = dataset.take(8, rank=1, world_size=2)
    assert batch.shape == (4, 257) and batch.max() < 4096
    assert (dataset.sample(0) == dataset.sample(0)).all()


def _small_documents():
    yield "def a():\n    pass\n"
    yield "x = 1\n"


def test_an_interrupted_default_build_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    def crashing_documents():
        yield "x = 1\n"
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(default_corpus, "iter_default_documents", crashing_documents)
    with pytest.raises(RuntimeError):
        default_corpus_dir(tmp_path)
    assert list((tmp_path / "corpus").iterdir()) == []

    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    corpus = default_corpus_dir(tmp_path)
    assert len(IndexedDataset(corpus / "stdlib")) == 2


def test_a_default_corpus_directory_without_manifest_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    corpus = default_corpus_dir(tmp_path)
    (corpus / "manifest.json").unlink()
    (corpus / "stdlib.bin").write_bytes(b"torn")
    assert default_corpus_dir(tmp_path) == corpus
    assert (corpus / "manifest.json").is_file()
    assert len(IndexedDataset(corpus / "stdlib")) == 2


def test_temporary_directories_of_killed_default_builds_are_removed_by_the_next_call(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    parent = tmp_path / "corpus"
    parent.mkdir()

    def build_directory(name: str, age_seconds: float):
        directory = parent / name
        directory.mkdir()
        (directory / "stdlib.bin.tmp").write_bytes(b"half-written")
        then = time.time() - age_seconds
        os.utime(directory, (then, then))
        return directory

    build_directory(".stdlib-py3.11-0123456789ab.tmp-killed", 3600)  # kill -9 an hour ago
    build_directory(".stdlib-py3.12-ba9876543210.tmp-killed", 3600)  # another Python's
    # Just made by a build that has not locked it yet, and one a running build holds.
    new = build_directory(".stdlib-py3.11-0123456789ab.tmp-new", 1)
    running = build_directory(".stdlib-py3.11-0123456789ab.tmp-running", 3600)
    (parent / "notes").mkdir()  # not a default build's
    with build_lock(running):
        corpus = default_corpus_dir(tmp_path)
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [corpus.name, new.name, running.name, "notes"]
    )
    assert (running / "stdlib.bin.tmp").read_bytes() == b"half-written"
    build_directory(".stdlib-py3.11-0123456789ab.tmp-killed-later", 3600)
    # Cached, and the debris goes all the same; the lock released, `running` is debris too.
    assert default_corpus_dir(tmp_path) == corpus
    assert sorted(p.name for p in parent.iterdir()) == sorted([corpus.name, new.name, "notes"])


def test_without_flock_only_long_abandoned_default_build_directories_are_removed(
    tmp_path, monkeypatch
):
    import errno
    import fcntl

    def no_flock(fd, op):  # NFS: no telling whether a build holds one
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    parent = tmp_path / "corpus"
    parent.mkdir()
    for name, age_seconds in (("killed", 2 * 3600), ("maybe-running", 1800)):
        directory = parent / f".stdlib-py3.11-0123456789ab.tmp-{name}"
        directory.mkdir()
        then = time.time() - age_seconds
        os.utime(directory, (then, then))
    with pytest.warns(UserWarning, match="cannot lock"):
        corpus = default_corpus_dir(tmp_path)
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [corpus.name, ".stdlib-py3.11-0123456789ab.tmp-maybe-running"]
    )


def test_cli_build_default_writes_the_corpus_into_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    assert main(["build-default", "--output", str(tmp_path / "out"), "--no-progress"]) == 0
    assert "2 documents" in capsys.readouterr().out
    dataset = TokenDataset(tmp_path / "out", 4)
    assert dataset.eos_id == 0 and np.all(dataset.sample(0) < 4096)


def test_a_concurrent_build_that_finishes_first_wins_and_ours_is_discarded(tmp_path, monkeypatch):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    monkeypatch.setenv("MT_CACHE_DIR", str(tmp_path))
    real_build = default_corpus.build_default_corpus
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    final = tmp_path / "corpus" / f"stdlib-py{version}-{default_corpus._corpus_key()}"

    def build_while_another_process_finishes_first(output, **kwargs):
        real_build(output, **kwargs)
        real_build(final)  # the other process's complete corpus lands under the final name
        (final / "winner").touch()

    monkeypatch.setattr(
        default_corpus, "build_default_corpus", build_while_another_process_finishes_first
    )
    assert default_corpus_dir() == final
    assert (final / "winner").is_file()
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_cli_build_default_refuses_a_directory_of_mt_data_build_and_deletes_nothing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    out = tmp_path / "out"
    argv = ["build", "--tokenizer", str(default_tokenizer_path()), "--output", str(out),
            "--workers", "0", "--no-progress", str(tmp_path / "a.jsonl")]  # fmt: skip
    assert main(argv) == 0  # the same tokenizer as the default corpus's
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["build-default", "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"output {out} holds .mt-data, a.bin, a.idx, which build-default did not" in err
    assert "choose a new or empty output directory" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    assert main(["build-default", "--output", str(tmp_path / "notes"), "--no-progress"]) == 2
    assert "holds todo.txt" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def test_build_default_replaces_an_earlier_default_corpus_even_an_interrupted_one(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(default_corpus, "iter_default_documents", lambda: iter(["x = 1\n"]))
    out = default_corpus.build_default_corpus(tmp_path / "out")
    assert len(IndexedDataset(out / "stdlib")) == 1
    (out / "manifest.json").unlink()  # interrupted mid-build: the manifest goes first
    (out / "stdlib.bin.tmp").write_bytes(b"torn")
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    assert default_corpus.build_default_corpus(out) == out
    assert len(IndexedDataset(out / "stdlib")) == 2
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "stdlib.bin", "stdlib.idx"]


def test_on_build_is_told_the_directory_before_a_build_and_not_when_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(default_corpus, "iter_default_documents", _small_documents)
    told = []

    def on_build(path):
        told.append(path)
        assert not path.exists(), "called before the build"

    corpus = default_corpus_dir(tmp_path, on_build=on_build)
    assert told == [corpus]
    assert default_corpus_dir(tmp_path, on_build=on_build) == corpus
    assert told == [corpus]  # cached: no build, no call
