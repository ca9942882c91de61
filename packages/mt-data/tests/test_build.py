"""build_corpus: shards per input, resume, bad lines, compressed inputs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

import mt_data.build as build_module
from mt_data import IndexedDataset, build_corpus
from mt_data.build import CorpusError, build_documents
from mt_data.cli import main
from mt_data.default_corpus import default_tokenizer_path
from mt_data.sources import input_kind
from mt_data.tokenizer import load_tokenizer


def jsonl_bytes(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jsonl_bytes(texts, key))
    return path


TEXTS_A = ["def f(x):\n    return x + 1\n", "héllo wörld 🎉", "import os\n" * 20]
TEXTS_B = ["class A:\n    pass\n", "x = [1, 2, 3]"]


def _build(inputs, output, **kwargs):
    kwargs.setdefault("workers", 0)  # in-process: no worker start-up time in unit tests
    return build_corpus(inputs, default_tokenizer_path(), output, progress=False, **kwargs)


def test_each_input_becomes_one_shard_of_its_documents_in_order_with_eos(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "in" / "b.jsonl", TEXTS_B)
    summary = _build([a, b], tmp_path / "out")
    assert [s.name for s in summary.shards] == ["a", "b"]
    for name, texts in (("a", TEXTS_A), ("b", TEXTS_B)):
        shard = IndexedDataset(tmp_path / "out" / name)
        assert shard.dtype == np.uint16
        assert len(shard) == len(texts)
        for i, text in enumerate(texts):
            expected = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
            assert shard[i].tolist() == [*expected, tokenizer.eos_id]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 4096
    assert manifest["dtype"] == "uint16"
    assert manifest["eos_id"] == tokenizer.eos_id
    assert manifest["format_version"] == 2
    assert manifest["inputs"] == [str(a), str(b)]
    assert manifest["num_documents"] == summary.num_documents == 5
    assert manifest["num_tokens"] == summary.num_tokens


def test_rebuild_is_byte_identical(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A * 50)
    _build([a], tmp_path / "one")
    _build([a], tmp_path / "two")
    for name in ("a.bin", "a.idx", "manifest.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_rerun_skips_finished_shards_and_rebuilds_unfinished_ones(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "b.jsonl", TEXTS_B)
    out = tmp_path / "out"
    _build([a, b], out)
    a_idx_inode = (out / "a.idx").stat().st_ino
    b_bin = (out / "b.bin").read_bytes()
    # Simulate a crash while writing b: its final files are gone, temporaries remain.
    os.replace(out / "b.bin", out / "b.bin.tmp")
    os.replace(out / "b.idx", out / "b.idx.tmp")
    (out / "manifest.json").unlink()

    summary = _build([a, b], out)
    assert [s.resumed for s in summary.shards] == [True, False]
    assert summary.shards[0].documents == 3 and summary.shards[0].bad_lines == 0
    assert (out / "a.idx").stat().st_ino == a_idx_inode
    assert (out / "b.bin").read_bytes() == b_bin
    assert not list(out.glob("*.tmp"))
    assert summary.num_documents == len(TEXTS_A) + len(TEXTS_B)
    assert json.loads((out / "manifest.json").read_text())["shards"][0]["documents"] == 3


def test_a_truncated_final_shard_is_rebuilt_not_skipped(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    out = tmp_path / "out"
    _build([a], out)
    good = (out / "a.bin").read_bytes()
    (out / "a.bin").write_bytes(good[:-4])
    summary = _build([a], out)
    assert not summary.shards[0].resumed
    assert (out / "a.bin").read_bytes() == good


def test_output_built_with_another_tokenizer_is_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    _build([a], tmp_path / "out")
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_bytes(default_tokenizer_path().read_bytes() + b"\n")
    with pytest.raises(ValueError, match="choose a new output directory"):
        build_corpus([a], other, tmp_path / "out", progress=False)


BAD_LINES = [
    b'{"text": "good one"}\n',  # 1
    b'{"text": "unterminated\n',  # 2 malformed JSON
    b'{"body": "no text key"}\n',  # 3 missing field
    b'{"text": 42}\n',  # 4 not a string
    b'{"text": "bad \xff\xfe utf8"}\n',  # 5 invalid UTF-8
    b'{"text": ""}\n',  # 6 empty document: counted, not a bad line
    b"\n",  # 7 blank: ignored
    b'["text"]\n',  # 8 not an object
    b'{"text": "lone \\ud800 surrogate"}\n',  # 9 not encodable text
    b'{"text": "good two"}\n',  # 10
]


def test_skip_mode_counts_bad_lines_and_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(BAD_LINES))
    summary = _build([path], tmp_path / "out")
    assert summary.num_documents == 2
    assert summary.num_empty_documents == 1
    assert summary.num_bad_lines == 6
    assert [str(b).split(": ")[0] for b in summary.bad_lines] == [
        f"{path}:{n}" for n in (2, 3, 4, 5, 8, 9)
    ]
    reasons = " | ".join(b.reason for b in summary.bad_lines)
    for word in ("malformed JSON", "no 'text' field", "not a string", "UTF-8", "JSON object"):
        assert word in reasons
    expected_kinds = {
        "invalid_utf8": 2,
        "malformed_json": 1,
        "missing_text": 1,
        "non_string_text": 1,
        "not_an_object": 1,
    }
    assert summary.bad_lines_by_kind == expected_kinds
    manifest = json.loads(summary.manifest_path.read_text())
    assert manifest["bad_lines_by_kind"] == expected_kinds
    assert manifest["num_bad_lines"] == 6 and manifest["num_empty_documents"] == 1


def test_fail_mode_raises_at_the_first_bad_line_and_leaves_no_shard(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(BAD_LINES))
    with pytest.raises(CorpusError, match=rf"{path}:2: malformed JSON"):
        _build([path], tmp_path / "out", on_error="fail")
    assert list((tmp_path / "out").iterdir()) == []
    # A shard built under "skip" holds skipped lines: "fail" must not reuse it and succeed.
    _build([path], tmp_path / "skipped")
    before = {p: p.read_bytes() for p in (tmp_path / "skipped").rglob("*") if p.is_file()}
    with pytest.raises(CorpusError, match=rf"{path}:2: malformed JSON .*skipped when shard bad "
                       r"was built, 6 bad lines in all\); fix the input"):  # fmt: skip
        _build([path], tmp_path / "skipped", on_error="fail")
    assert {p: p.read_bytes() for p in (tmp_path / "skipped").rglob("*") if p.is_file()} == before


def test_cli_fail_mode_exits_2_naming_file_and_line_without_traceback(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(BAD_LINES))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mt_data",
            "build",
            str(path),
            "--tokenizer",
            str(default_tokenizer_path()),
            "--output",
            str(tmp_path / "out"),
            "--on-error",
            "fail",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert f"{path}:2: malformed JSON" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_skip_mode_prints_skipped_lines_and_succeeds(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(BAD_LINES))
    status = main(
        [
            "build",
            str(path),
            "--tokenizer",
            str(default_tokenizer_path().parent),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0
    assert f"skipped {path}:3: no 'text' field" in captured.err
    assert "2 documents" in captured.out and "6 bad lines" in captured.out


@pytest.mark.parametrize(
    "argv",
    [
        ["build", "missing.jsonl", "--tokenizer", str(default_tokenizer_path()), "--output", "o"],
        ["build", "data/*.jsonl", "--tokenizer", str(default_tokenizer_path()), "--output", "o"],
        ["build", "x.jsonl", "--tokenizer", "no/such/tokenizer.json", "--output", "o"],
        # was dropped silently: the build succeeded without BOS
        ["build", "x.jsonl", "--tokenizer", str(default_tokenizer_path()), "--output", "o",
         "--workers", "0", "--bos-token", ""],
    ],
    ids=["missing-file", "empty-glob", "missing-tokenizer", "empty-bos-token"],
)
def test_cli_user_mistakes_exit_2_with_a_message(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_an_input_that_is_a_pipe_is_refused_as_not_a_file_not_as_missing(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")  # as `mt-data build <(zstdcat a.jsonl.zst)` passes
    with pytest.raises(ValueError, match=r"fifo.jsonl: not a regular file or directory; save"):
        _build([tmp_path / "fifo.jsonl"], tmp_path / "out")


def test_zstd_inputs_with_several_frames_read_like_plain_jsonl(tmp_path):
    texts = [f"document number {i}\n" * (i % 7 + 1) for i in range(40)]
    write_jsonl(tmp_path / "plain" / "c.jsonl", texts)
    compressor = zstandard.ZstdCompressor()
    half = jsonl_bytes(texts[:25]), jsonl_bytes(texts[25:])
    frames = compressor.compress(half[0]) + compressor.compress(half[1])
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "c.jsonl.zst").write_bytes(frames)
    (tmp_path / "zstd").mkdir()
    (tmp_path / "zstd" / "c.jsonl.zstd").write_bytes(compressor.compress(half[0] + half[1]))
    for kind in ("plain", "zst", "zstd"):
        _build([tmp_path / kind], tmp_path / f"out-{kind}")
    plain = (tmp_path / "out-plain" / "c.bin").read_bytes()
    assert len(IndexedDataset(tmp_path / "out-plain" / "c")) == 40
    assert (tmp_path / "out-zst" / "c.bin").read_bytes() == plain
    assert (tmp_path / "out-zstd" / "c.bin").read_bytes() == plain


def test_directories_and_globs_expand_and_same_stems_get_unique_names(tmp_path):
    write_jsonl(tmp_path / "d1" / "part.jsonl", ["one"])
    write_jsonl(tmp_path / "d2" / "part.jsonl", ["two"])
    write_jsonl(tmp_path / "d2" / "other.jsonl", ["three"])
    (tmp_path / "d2" / "notes.txt").write_text("ignored")
    summary = _build([tmp_path / "d1", str(tmp_path / "d2" / "*.jsonl")], tmp_path / "out")
    names = [s.name for s in summary.shards]
    assert len(set(names)) == 3
    assert names[1] == "other"  # glob matches sorted: other.jsonl, then part.jsonl
    assert names[0].startswith("part-") and names[2].startswith("part-")
    assert summary.num_documents == 3
    # Part.bin and part.bin are one file on macOS and Windows: the first shard was lost.
    write_jsonl(tmp_path / "d3" / "Part.jsonl", ["four"])
    summary = _build([tmp_path / "d3", tmp_path / "d1"], tmp_path / "out2")
    names = [s.name for s in summary.shards]
    assert names[0].startswith("Part-") and names[1].startswith("part-")
    write_jsonl(tmp_path / "d4" / "caf\u00e9.jsonl", ["five"])  # é, then e + combining accent
    write_jsonl(tmp_path / "d5" / "cafe\u0301.jsonl", ["six"])
    summary = _build([tmp_path / "d4", tmp_path / "d5"], tmp_path / "out3")
    assert all("-" in s.name for s in summary.shards)


def test_inputs_linked_to_blobs_without_a_suffix_are_read_and_named_by_the_link(tmp_path):
    # The Hugging Face hub cache: snapshots/<rev>/train.jsonl -> ../../blobs/<hash>.
    blob = write_jsonl(tmp_path / "blobs" / "3f2a9c", TEXTS_A)
    compressed = tmp_path / "blobs" / "77e0b1"
    compressed.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS_B)))
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "train.jsonl").symlink_to(blob)
    (tmp_path / "snap" / "valid.jsonl.zst").symlink_to(compressed)
    (tmp_path / "snap" / "again.jsonl").symlink_to(blob)  # the same file twice: read once
    summary = _build([tmp_path / "snap" / "train.jsonl", tmp_path / "snap"], tmp_path / "out")
    # Was: shards 3f2a9c and 77e0b1, each a 'corrupt zstandard data' bad line, no documents.
    assert [(s.name, s.documents) for s in summary.shards] == [
        ("train", len(TEXTS_A)), ("valid", len(TEXTS_B))
    ]
    assert summary.num_bad_lines == 0


def test_same_stems_of_file_names_that_are_not_utf8_get_unique_names(tmp_path):
    # b"caf\xe9" (Latin-1) reads back as "caf\udce9", which str.encode() refused.
    inputs = []
    for part in ("d1", "d2"):
        (tmp_path / part).mkdir()
        name = os.fsdecode(os.fsencode(tmp_path / part) + b"/caf\xe9.jsonl")
        inputs.append(write_jsonl(Path(name), [part]))
    summary = _build(inputs, tmp_path / "out")
    names = [s.name for s in summary.shards]
    assert len(set(names)) == 2 and all(n.startswith("caf\udce9-") for n in names)
    assert summary.num_documents == 2


def test_an_input_named_only_by_its_suffix_gets_a_shard_inside_the_output(tmp_path):
    from mt_data import TokenDataset

    write_jsonl(tmp_path / "in" / ".jsonl", TEXTS_A)  # stem "": the shard was out.bin/.idx
    write_jsonl(tmp_path / "in" / "..jsonl", TEXTS_B)  # stem ".": the same
    summary = _build([tmp_path / "in"], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    assert sorted(s.name for s in summary.shards) == ["..jsonl", ".jsonl"]
    assert TokenDataset(tmp_path / "out", seq_len=4).num_tokens == summary.num_tokens
    assert _build([tmp_path / "in"], tmp_path / "out").num_resumed == 2


def test_build_documents_writes_one_shard_and_skips_empty_documents(tmp_path, tokenizer):
    summary = build_documents(["a b", "", "c"], tokenizer, tmp_path / "docs")
    assert (summary.documents, summary.empty_documents) == (2, 1)
    shard = IndexedDataset(tmp_path / "docs")
    assert all(shard[i][-1] == tokenizer.eos_id for i in range(len(shard)))


def test_eos_falls_back_to_a_known_token_without_tokenizer_config(tmp_path):
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_bytes(default_tokenizer_path().read_bytes())
    assert load_tokenizer(bare).eos_token == "<|endoftext|>"
    config = bare.parent / "tokenizer_config.json"
    config.write_text('{"eos_token": {"content": "<|endoftext|>"}}')
    assert load_tokenizer(bare.parent).eos_id == 0
    config.write_text('{"eos_token": "<missing>"}')
    with pytest.raises(ValueError, match="'<missing>'.*not in the vocabulary"):
        load_tokenizer(bare)


def test_eos_token_argument_overrides_the_config(tmp_path, tokenizer, capsys):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<missing>"}')
    with pytest.raises(ValueError, match="'<missing>'.*not in the vocabulary"):
        load_tokenizer(directory)
    assert load_tokenizer(directory, eos_token="<|endoftext|>").eos_id == tokenizer.eos_id
    path = write_jsonl(tmp_path / "e.jsonl", ["x"])
    argv = ["build", str(path), "--tokenizer", str(directory), "--output", str(tmp_path / "o")]
    assert main([*argv, "--eos-token", "<|endoftext|>", "--no-progress", "--workers", "0"]) == 0
    assert IndexedDataset(tmp_path / "o" / "e")[0].tolist()[-1] == tokenizer.eos_id
    # inspect decodes with the manifest's tokenizer, whose config names no usable EOS
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "o")]) == 0
    assert "x<|endoftext|>" in capsys.readouterr().out


def test_a_changed_or_different_input_is_rebuilt_not_reused(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a" / "train.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "b" / "train.jsonl", TEXTS_B)
    _build([a], tmp_path / "out")
    summary = _build([b], tmp_path / "out")  # another file with the same stem
    assert (summary.num_resumed, summary.num_documents) == (0, len(TEXTS_B))
    assert _build([b], tmp_path / "out").num_resumed == 1  # unchanged: reused
    with open(b, "ab") as f:
        f.write(jsonl_bytes(["appended = True"]))
    summary = _build([b], tmp_path / "out")
    assert (summary.num_resumed, summary.num_documents) == (0, len(TEXTS_B) + 1)
    last = IndexedDataset(tmp_path / "out" / "train")[len(TEXTS_B)].tolist()
    assert tokenizer.tokenizer.decode(last[:-1]) == "appended = True"


def test_an_input_appended_to_while_it_is_read_is_rebuilt_by_the_next_run(tmp_path,
                                                                          monkeypatch):  # fmt: skip
    import mt_data.build

    path = write_jsonl(tmp_path / "log.jsonl", TEXTS_B)
    read_batches = mt_data.build.iter_batches

    def read_then_append(*args):  # a writer appends just after the build read to the end
        yield from read_batches(*args)
        with open(path, "ab") as f:
            f.write(jsonl_bytes(["late = 1"]))

    with monkeypatch.context() as m:
        m.setattr(mt_data.build, "iter_batches", read_then_append)
        assert _build([path], tmp_path / "out").num_documents == len(TEXTS_B)
    # The record held the size after the append, so this run reused the shard without it.
    summary = _build([path], tmp_path / "out")
    assert (summary.num_resumed, summary.num_documents) == (0, len(TEXTS_B) + 1)


def test_a_rebuild_interrupted_after_its_record_is_redone_not_taken_for_the_old_shard(
    tmp_path, tokenizer, monkeypatch
):
    from mt_data.indexed import IndexedDatasetWriter

    path = write_jsonl(tmp_path / "in.jsonl", ["hello a"])
    _build([path], tmp_path / "out")
    write_jsonl(path, ["hello b"])  # the same documents and tokens, other ids
    new = tokenizer.encode_documents(["hello b"])[0]
    assert len(new) == len(IndexedDataset(tmp_path / "out" / "in")[0]) != 0

    def interrupted(self):  # Ctrl-C while the new index is written, after the record
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(IndexedDatasetWriter, "_write_index_tail", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _build([path], tmp_path / "out")
    summary = _build([path], tmp_path / "out")
    assert summary.num_resumed == 0
    assert IndexedDataset(tmp_path / "out" / "in")[0].tolist() == new


def test_an_interrupted_rebuild_of_a_corpus_without_build_records_is_refused_by_readers(
    tmp_path, monkeypatch
):
    import shutil

    from mt_data import TokenDataset
    from mt_data.indexed import IndexedDatasetWriter

    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "b.jsonl", TEXTS_B)
    _build([a, b], tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / ".mt-data")  # as an mt-data without build records left it

    def interrupted(self, tokens, lengths):  # Ctrl-C while shard a is written
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexedDatasetWriter, "add_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _build([a, b], tmp_path / "out")  # no records: both shards are rewritten
    with pytest.raises(ValueError, match="has not finished"):  # not shard b alone
        TokenDataset(tmp_path / "out", seq_len=4)


def test_shards_an_earlier_build_no_longer_lists_are_removed_and_never_read(tmp_path):
    from mt_data import TokenDataset

    a = write_jsonl(tmp_path / "x" / "a.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "x" / "b.jsonl", TEXTS_B)
    c = write_jsonl(tmp_path / "y" / "a.jsonl", TEXTS_B)  # stem clash: hashed names
    first = _build([a, b, c], tmp_path / "out")
    build_documents(["not built by build_corpus"], default_tokenizer_path(), tmp_path / "out" / "m")
    summary = _build([a], tmp_path / "out")  # "a" now: the hashed names are stale too
    assert sorted(summary.removed) == sorted(s.name for s in first.shards)
    names = sorted(p.name for p in (tmp_path / "out").glob("*.idx"))
    assert names == ["a.idx", "m.idx"]  # a shard without a build record is left alone
    with pytest.warns(UserWarning, match=r"shards \['m'\] are not in its manifest.json"):
        dataset = TokenDataset(tmp_path / "out", seq_len=4)
    assert dataset.num_tokens == summary.num_tokens  # the manifest's shards only


def test_a_failed_rebuild_keeps_the_old_corpus_unless_it_rewrote_one_of_its_shards(tmp_path):
    from mt_data import TokenDataset

    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    b = write_jsonl(tmp_path / "b.jsonl", TEXTS_B)
    bad = tmp_path / "c.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": broken\n')
    out = tmp_path / "out"
    tokens = _build([a, b], out).num_tokens
    for inputs in ([a, b, bad], [a, bad]):  # adding a shard fails; b is not dropped either
        with pytest.raises(CorpusError):
            _build(inputs, out, on_error="fail")
        assert TokenDataset(out, seq_len=4).num_tokens == tokens
    with open(b, "ab") as f:  # b changes and then fails: its listed shard is being rewritten
        f.write(b'{"text": broken\n')
    with pytest.raises(CorpusError):
        _build([a, b], out, on_error="fail")
    with pytest.raises(ValueError, match="has not finished"):
        TokenDataset(out, seq_len=4)


def test_a_file_system_without_flock_builds_with_a_warning(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    with pytest.warns(UserWarning, match="cannot lock the directory"):
        assert _build([a], tmp_path / "out").num_documents == len(TEXTS_A)


def test_an_unfinished_build_is_refused_by_readers(tmp_path):
    from mt_data import TokenDataset

    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    _build([a], tmp_path / "out")
    (tmp_path / "out" / "manifest.json").unlink()  # as a build killed before its end
    with pytest.raises(ValueError, match="has not finished.*rerun the same"):
        TokenDataset(tmp_path / "out", seq_len=4)


def test_a_second_build_into_the_same_directory_is_refused_while_one_runs(tmp_path):
    from mt_data.build import build_lock

    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    (tmp_path / "out").mkdir()
    with (
        build_lock(tmp_path / "out"),
        pytest.raises(ValueError, match="another mt-data build is writing"),
    ):
        _build([a], tmp_path / "out")
    assert _build([a], tmp_path / "out").num_documents == len(TEXTS_A)  # released


def test_vocab_size_is_the_largest_id_plus_one_when_ids_have_gaps(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 70000}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "sparse" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    assert load_tokenizer(path).vocab_size == 70001
    a = write_jsonl(tmp_path / "a.jsonl", ["hello world"])
    build_corpus([a], path, tmp_path / "out", workers=0, progress=False)
    assert IndexedDataset(tmp_path / "out" / "a")[0].tolist() == [2, 70000, 0]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["vocab_size"], manifest["dtype"]) == (70001, "int32")
    from mt_data.default_corpus import build_default_corpus

    with pytest.raises(ValueError, match="choose a new output directory"):
        build_default_corpus(tmp_path / "out")  # made with another tokenizer


def test_cli_bos_flag_does_not_take_the_input_as_its_token(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", ["x = 1"])
    out = tmp_path / "out"
    argv = ["build", "--tokenizer", str(default_tokenizer_path()), "--output", str(out),
            "--workers", "0", "--no-progress", "--bos-token", "<|endoftext|>", str(a)]  # fmt: skip
    assert main(argv) == 0
    ids = IndexedDataset(out / "a")[0].tolist()
    assert ids[0] == ids[-1] == tokenizer.eos_id


def test_a_tokenizer_json_that_truncates_or_pads_still_stores_whole_documents(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    # Hub tokenizer.json files may carry truncation and padding settings (for a model's
    # inputs); a document must be stored whole, unpadded, whatever they say.
    saved = Tokenizer.from_file(str(default_tokenizer_path()))
    saved.enable_truncation(max_length=4)
    saved.enable_padding(pad_id=tokenizer.eos_id, pad_token=tokenizer.eos_token)
    path = tmp_path / "padded" / "tokenizer.json"
    path.parent.mkdir()
    saved.save(str(path))
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    build_corpus([a], path, tmp_path / "out", workers=0, progress=False)
    shard = IndexedDataset(tmp_path / "out" / "a")
    expected = tokenizer.encode_documents(TEXTS_A)
    assert max(len(ids) for ids in expected) > 4
    assert [shard[i].tolist() for i in range(len(shard))] == expected


def test_default_workers_follow_the_cgroup_cpu_quota_not_the_host_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/docker/abc\n")
    v2 = tmp_path / "v2"
    (v2 / "docker" / "abc").mkdir(parents=True)
    assert build_module.default_workers(v2) == 128  # no quota anywhere
    (v2 / "docker" / "abc" / "cpu.max").write_text("max 100000\n")
    (v2 / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs at the top: 2 workers
    assert build_module.cgroup_cpu_quota(v2, proc) == 2
    (v2 / "docker" / "abc" / "cpu.max").write_text("50000 100000\n")  # the tighter one wins
    assert build_module.cgroup_cpu_quota(v2, proc) == 1
    (v2 / "cpu.max").write_text("200000 100000\n")
    (v2 / "docker" / "abc" / "cpu.max").unlink()
    assert build_module.default_workers(v2) == 2  # this process's own /proc/self/cgroup
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert build_module.default_workers(v1) == 128
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert build_module.default_workers(v1) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert build_module.default_workers(v1) == 2  # fewer cores than the quota


def test_upper_case_input_suffixes_are_read_and_lower_case_shard_names_stay_the_same(tmp_path):
    write_jsonl(tmp_path / "in" / "a.JSONL", TEXTS_A)
    (tmp_path / "in" / "b.jsonl.ZST").write_bytes(
        zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS_B))
    )
    write_jsonl(tmp_path / "in" / "c.jsonl", TEXTS_B)
    summary = _build([tmp_path / "in"], tmp_path / "out")
    assert [s.name for s in summary.shards] == ["a", "b", "c"]
    assert [len(IndexedDataset(tmp_path / "out" / n)) for n in "abc"] == [3, 2, 2]
    assert input_kind("x.PARQUET") == "parquet"
    assert input_kind("x.Jsonl.Zstd") == "jsonl"


def test_a_rerun_with_other_settings_names_the_setting_its_option_and_both_values(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS_A)
    _build([a], tmp_path / "out")
    with pytest.raises(ValueError) as err:
        _build([a], tmp_path / "out", text_key="body", bos="<|endoftext|>")
    message = str(err.value)
    assert "text_key 'text' (--text-key), this build 'body'" in message
    assert "bos_id None (--bos, --bos-token), this build 0" in message
    assert "tokenizer_sha256" not in message and "eos_id" not in message  # unchanged
    assert "choose a new output directory" in message


def test_cli_build_help_says_that_shards_of_an_earlier_build_it_does_not_list_are_removed(
    capsys,
):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "not among this build's inputs are removed" in help_text
