"""The builder under stress: worker counts, kills, broken inputs, Parquet, special tokens."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

import mt_data.sources as sources
from mt_data import IndexedDataset, build_corpus
from mt_data.build import CorpusError
from mt_data.cli import main
from mt_data.default_corpus import default_tokenizer_path, iter_default_documents
from mt_data.inspection import inspect_corpus
from mt_data.tokenizer import load_tokenizer


def _documents(num_bytes: int) -> list[str]:
    """Real, varied text: standard library sources, cut into pieces of a few KB."""
    texts: list[str] = []
    size = 0
    for source in iter_default_documents():
        for start in range(0, len(source), 3000):
            texts.append(source[start : start + 3000])
            size += len(texts[-1])
            if size >= num_bytes:
                return texts
    return texts


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _expected(tokenizer, texts: list[str]) -> list[list[int]]:
    return [
        [*tokenizer.tokenizer.encode(t, add_special_tokens=False).ids, tokenizer.eos_id]
        for t in texts
    ]


def test_output_is_byte_identical_for_0_1_and_2_workers(tmp_path, tokenizer, monkeypatch):
    # Small batches, so one file is split among the workers and batches straddle files.
    monkeypatch.setattr(sources, "BATCH_BYTES", 8192)
    big = _documents(120_000)
    inputs = [
        _write_jsonl(tmp_path / "in" / "big.jsonl", big),
        _write_jsonl(tmp_path / "in" / "small.jsonl", ["x = 1", "", "y = 2"]),
        _write_jsonl(tmp_path / "in" / "empty.jsonl", []),
    ]
    trees = []
    for workers in (0, 1, 2):
        out = tmp_path / f"out-{workers}"
        build_corpus(inputs, default_tokenizer_path(), out, workers=workers, progress=False)
        trees.append(_tree(out))
    assert trees[0] == trees[1] == trees[2]
    assert {"big.bin", "big.idx", "small.idx", "empty.idx", "manifest.json"} <= set(trees[0])
    shard = IndexedDataset(tmp_path / "out-2" / "big")
    assert [shard[i].tolist() for i in range(len(shard))] == _expected(tokenizer, big)
    assert len(IndexedDataset(tmp_path / "out-2" / "empty")) == 0


def _cli_build(inputs: list[Path], out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "mt_data", "build", *map(str, inputs),
        "--tokenizer", str(default_tokenizer_path()), "--output", str(out), *extra,
    ]  # fmt: skip


def test_a_build_killed_at_random_points_resumes_to_byte_identical_output(tmp_path):
    texts = _documents(900_000)
    inputs = [_write_jsonl(tmp_path / "in" / f"part{i}.jsonl", texts[i::6]) for i in range(6)]
    reference = tmp_path / "reference"
    build_corpus(inputs, default_tokenizer_path(), reference, workers=0, progress=False)
    expected = _tree(reference)

    out = tmp_path / "out"
    rng = random.Random(0)
    kills = 0
    for _ in range(6):  # kill, restart, kill, ... until a run gets to finish
        process = subprocess.Popen(
            _cli_build(inputs, out, "--workers", "1", "--no-progress"),
            start_new_session=True,  # its own process group: the worker dies with it
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Kill only once the build is visibly mid-shard (a temporary file exists), plus a
        # random delay, so the kill lands inside a shard however fast the machine is.
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            if any(out.glob("*.tmp")):
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.2))
        if process.poll() is not None:
            break
        os.killpg(process.pid, signal.SIGKILL)  # like a power cut: no clean-up at all
        process.wait()
        kills += 1
        # Whatever is under a final name is complete and right.
        for idx in out.glob("*.idx"):
            assert idx.read_bytes() == expected[idx.name]
            assert idx.with_suffix(".bin").read_bytes() == expected[idx.with_suffix(".bin").name]
    assert kills >= 1, "the build finished before it could be killed once"
    result = subprocess.run(_cli_build(inputs, out, "--workers", "2", "--no-progress"),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _tree(out) == expected


def _starting_worker(parent: int) -> int | None:
    """A spawned worker of process `parent` that is starting: its Python has installed its
    SIGINT handler (KeyboardInterrupt), its initializer has not yet ignored SIGINT."""
    sigint = 1 << (signal.SIGINT - 1)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != parent or b"spawn_main" not in (stat.parent / "cmdline").read_bytes():
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
        masks = dict(line.split(":\t") for line in status.splitlines() if line.startswith("Sig"))
        if int(masks["SigCgt"], 16) & sigint and not int(masks["SigIgn"], 16) & sigint:
            return int(stat.parent.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("presses", [1, 2], ids=["pressed-once", "pressed-twice"])
def test_ctrl_c_while_workers_start_exits_130_with_one_message_and_no_worker_traceback(
    tmp_path, presses
):
    # Ctrl-C signals the whole process group; a second press (or `uv run` without a
    # terminal, which forwards SIGINT) reaches the main process while it stops the workers.
    path = _write_jsonl(tmp_path / "in.jsonl", _documents(600_000))  # batches for 2 workers
    out = tmp_path / "out"
    process = subprocess.Popen(
        _cli_build([path], out, "--workers", "2", "--no-progress"),
        start_new_session=True,
        # A shell's background job (`pytest &`, nohup) ignores SIGINT, and so would the
        # build it starts; a terminal's Ctrl-C reaches a build that handles it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while _starting_worker(process.pid) is None:
            assert process.poll() is None and time.monotonic() < deadline, "no starting worker"
            time.sleep(0.002)
        os.killpg(process.pid, signal.SIGINT)  # while the worker imports numpy, tokenizers
        if presses == 2:
            time.sleep(0.05)
            process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, stderr) == (
        130,
        "mt-data: interrupted; rerun the same command to resume\n",
    )
    assert not (out / "manifest.json").exists()
    assert not [p.name for p in out.glob("*") if ".tmp" in p.name]


def _zstd(texts: list[str], checksum: bool = False) -> bytes:
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    return zstandard.ZstdCompressor(write_checksum=checksum).compress(data)


def test_a_truncated_zstd_file_keeps_the_complete_lines_and_reports_where_it_stopped(
    tmp_path, tokenizer
):
    texts = _documents(400_000)  # several 128 KiB zstd blocks
    data = _zstd(texts)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) * 2 // 3])
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    (bad,) = summary.bad_lines
    assert bad.kind == "corrupt_input" and "truncated zstandard data" in bad.reason
    assert str(bad).startswith(f"{path}:{bad.line}: ")
    shard = IndexedDataset(tmp_path / "out" / "cut")
    assert 0 < len(shard) == bad.line - 1 < len(texts)
    kept = [shard[i].tolist() for i in range(len(shard))]
    assert kept == _expected(tokenizer, texts[: len(shard)])


def test_corrupt_zstd_data_is_reported_not_raised(tmp_path):
    data = bytearray(_zstd(_documents(400_000), checksum=True))
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(bytes(data))
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    assert summary.bad_lines_by_kind == {"corrupt_input": 1}
    assert "corrupt zstandard data" in summary.bad_lines[0].reason


def test_zstd_made_with_a_long_window_is_read_not_called_corrupt(tmp_path, tokenizer):
    # As `zstd --long=30` writes: the frame declares a 1 GiB window, over the 128 MiB
    # that python-zstandard accepts by default.
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30, enable_ldm=True)
    path = tmp_path / "long.jsonl.zst"
    compressor = zstandard.ZstdCompressor(compression_params=params)
    with open(path, "wb") as f, compressor.stream_writer(f) as writer:
        writer.write(b'{"text": "a"}\n{"text": "b"}\n')
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    assert (summary.num_documents, summary.num_bad_lines) == (2, 0)


def test_a_line_nested_too_deeply_for_json_is_a_malformed_line_not_a_crash(tmp_path, tokenizer):
    path = tmp_path / "deep.jsonl"
    deep = "[" * 100_000  # json.loads raises RecursionError, not JSONDecodeError
    path.write_text(f'{{"text": "a"}}\n{deep}\n{{"text": "b"}}\n')
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    assert summary.bad_lines_by_kind == {"malformed_json": 1}
    assert str(summary.bad_lines[0]).startswith(f"{path}:2: malformed JSON")
    shard = IndexedDataset(tmp_path / "out" / "deep")
    assert [shard[i].tolist() for i in range(len(shard))] == _expected(tokenizer, ["a", "b"])
    with pytest.raises(CorpusError, match=rf"{path}:2: malformed JSON"):
        build_corpus([path], default_tokenizer_path(), tmp_path / "out2", workers=0,
                     on_error="fail", progress=False)  # fmt: skip


def test_cli_fail_mode_on_a_truncated_zstd_exits_nonzero_without_traceback_or_shard(tmp_path):
    data = _zstd(_documents(30_000))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    result = subprocess.run(
        _cli_build([path], out, "--on-error", "fail", "--workers", "1", "--no-progress"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert f"{path}:" in result.stderr and "truncated zstandard data" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(out.glob("*.idx")) and not list(out.glob("*.bin*"))
    assert not (out / "manifest.json").exists()


def test_fail_mode_stops_at_a_bad_line_in_a_later_batch_of_a_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BATCH_BYTES", 4096)
    texts = _documents(40_000)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[len(lines) - 3] = '{"text": 7}'
    path = tmp_path / "late.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=rf"{path}:{len(lines) - 2}: field 'text' is int"):
        build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=2,
                     on_error="fail", progress=False)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_special_token_text_inside_a_document_is_encoded_as_plain_text(tmp_path, tokenizer):
    text = "before <|endoftext|> after"
    path = _write_jsonl(tmp_path / "s.jsonl", [text])
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0, progress=False)
    ids = IndexedDataset(tmp_path / "out" / "s")[0].tolist()
    assert ids.count(tokenizer.eos_id) == 1 and ids[-1] == tokenizer.eos_id
    assert tokenizer.tokenizer.decode(ids[:-1], skip_special_tokens=False) == text


def test_bos_is_prepended_when_asked_and_must_exist(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "s.jsonl", ["x = 1"])
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                 bos="<|endoftext|>", progress=False)  # fmt: skip
    ids = IndexedDataset(tmp_path / "out" / "s")[0].tolist()
    assert ids == [tokenizer.eos_id, *_expected(tokenizer, ["x = 1"])[0]]
    with pytest.raises(ValueError, match="names no 'bos_token'"):
        build_corpus([path], default_tokenizer_path(), tmp_path / "o2", bos=True, progress=False)


def test_parquet_inputs_give_the_same_shard_as_jsonl_and_count_null_texts(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = _documents(20_000)
    pq.write_table(pa.table({"text": [*texts[:3], None, *texts[3:]]}), tmp_path / "p.parquet")
    _write_jsonl(tmp_path / "j" / "p.jsonl", texts)
    summary = build_corpus([tmp_path / "p.parquet"], default_tokenizer_path(), tmp_path / "a",
                           workers=1, progress=False)  # fmt: skip
    build_corpus([tmp_path / "j"], default_tokenizer_path(), tmp_path / "b", workers=0,
                 progress=False)  # fmt: skip
    assert (tmp_path / "a" / "p.bin").read_bytes() == (tmp_path / "b" / "p.bin").read_bytes()
    assert [str(b) for b in summary.bad_lines] == [
        f"{tmp_path / 'p.parquet'}:4: field 'text' is null"
    ]


def test_bos_without_a_tokenizer_config_json_says_there_is_none_and_names_the_fix(tmp_path):
    (tmp_path / "tok").mkdir()
    file = (tmp_path / "tok").resolve() / "tokenizer.json"
    file.write_bytes(default_tokenizer_path().read_bytes())  # no tokenizer_config.json
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path / "tok", bos=True)
    message = str(err.value)
    assert f"beside {file}, but there is no tokenizer_config.json" in message
    assert "--bos-token TOKEN" in message
    assert str(tmp_path / "tok" / "tokenizer_config.json") not in message
    config = default_tokenizer_path().resolve().parent / "tokenizer_config.json"  # no bos_token
    expected = rf"{re.escape(str(config))} names no 'bos_token', there is no special_tokens_map"
    with pytest.raises(ValueError, match=rf"{expected}.json; pass .* \(--bos-token TOKEN\)"):
        load_tokenizer(default_tokenizer_path(), bos=True)


def test_cli_inspect_prints_shards_counts_dtype_and_decoded_text(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "i.jsonl", ["def hello():\n    return 'world'\n", "x"])
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0, progress=False)
    assert main(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    shard = IndexedDataset(tmp_path / "out" / "i")
    assert f"i {2:>43} {shard.num_tokens:>15}  uint16".split() == out.splitlines()[1].split()
    assert "def hello():\n    return 'world'\n<|endoftext|>" in out
    assert out.splitlines()[2].split() == ["total", "(1", "shard)", "2", str(shard.num_tokens)]
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    _write_jsonl(tmp_path / "j.jsonl", ["y = 2\n"])
    build_corpus([path, tmp_path / "j.jsonl"], default_tokenizer_path(), tmp_path / "two",
                 workers=0, progress=False)  # fmt: skip
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "two")]) == 0
    assert capsys.readouterr().out.splitlines()[3].split()[:3] == ["total", "(2", "shards)"]


def test_inspect_does_not_decode_with_a_tokenizer_changed_since_the_build(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_bytes(default_tokenizer_path().read_bytes())
    path = _write_jsonl(tmp_path / "i.jsonl", ["def hello():\n    return 'world'\n"])
    build_corpus([path], tokenizer, tmp_path / "out", workers=0, progress=False)
    # Retrained in place: ids now mean other words.
    Tokenizer(WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tokenizer))
    report = inspect_corpus(tmp_path / "out")
    assert f"the manifest's tokenizer {tokenizer} has changed since the build" in report
    assert "--- i sequence 0" not in report  # nothing decoded with the wrong vocabulary
    assert "return 'world'" in inspect_corpus(tmp_path / "out", tokenizer=default_tokenizer_path())


def test_cli_inspect_into_a_pipe_closed_early_stops_quietly(tmp_path):
    path = _write_jsonl(tmp_path / "i.jsonl", [f"document {i} " * 40 for i in range(2000)])
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0, progress=False)
    command = [sys.executable, "-m", "mt_data", "inspect", str(tmp_path / "out"),
               "--documents", "2000"]  # fmt: skip
    # ~700 KB of output, more than a pipe holds: `| head -1` closes it while we write.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"shard")
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141
    assert stderr == ""  # was "mt-data inspect: error: [Errno 32] Broken pipe", status 2


def test_cli_inspect_interrupted_exits_130_without_promising_a_resume(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mt_data.cli.inspect_corpus", interrupted)
    assert main(["inspect", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "mt-data: interrupted\n"


def test_inspect_decodes_the_first_sequences_in_shard_order_and_says_so(tmp_path, capsys):
    _write_jsonl(tmp_path / "in" / "a.jsonl", ["a = 1\n"])
    _write_jsonl(tmp_path / "in" / "b.jsonl", ["b = 2\n"])
    build_corpus([tmp_path / "in"], default_tokenizer_path(), tmp_path / "out", workers=0,
                 progress=False)  # fmt: skip
    report = inspect_corpus(tmp_path / "out", documents=2)
    # One sequence per shard: the second comes from the second shard, not the first.
    assert "--- a sequence 0:" in report and "--- b sequence 0:" in report
    assert "b = 2" in report
    # The docstring and --help say what it does: sequences, continuing into later shards.
    assert "from the first shard" not in inspect_corpus.__doc__
    assert "later shards" in " ".join(inspect_corpus.__doc__.split())
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "later shards" in help_text and "sequences to decode" in help_text


def test_cli_inspect_refuses_a_missing_tokenizer_and_negative_counts(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "i.jsonl", ["x = 1\n"])
    build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0, progress=False)
    capsys.readouterr()
    missing = tmp_path / "missing.json"
    for extra, message in (
        (["--tokenizer", str(missing)], f"tokenizer {missing}: no such file"),
        (["--documents", "-1"], "--documents (-1) must be >= 0"),
        (["--characters", "-5"], "--characters (-5) must be >= 0"),
    ):
        assert main(["inspect", str(tmp_path / "out"), *extra]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.out == ""


def test_cli_build_names_a_bad_option_by_its_flag_and_writes_nothing(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "i.jsonl", ["x = 1\n"])
    for extra, message in (
        (["--workers", "-3"], "--workers (-3) must be >= 0 (0: tokenize in this process)"),
        (["--text-key", ""], "--text-key ('') must name a JSON field (Parquet column), e.g. "
                                 "--text-key text"),
    ):
        argv = ["build", str(path), "--tokenizer", str(default_tokenizer_path())]
        assert main([*argv, "--output", str(tmp_path / "out"), "--no-progress", *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"mt-data build: error: {message}\n", captured.err
        assert not (tmp_path / "out").exists()


def test_written_shards_are_memory_bounded_by_the_batch_not_the_file(tmp_path):
    # The writer keeps no per-document list in memory: lengths go straight to the index.
    from mt_data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "s", np.uint16) as writer:
        for _ in range(3):
            writer.add_documents(np.arange(10, dtype=np.int64), np.array([4, 0, 6]))
        assert not any(isinstance(v, list) for v in vars(writer).values())
    shard = IndexedDataset(tmp_path / "s")
    assert shard.sequence_lengths.tolist() == [4, 0, 6] * 3
    assert shard.sequence_pointers.tolist() == [0, 8, 8, 20, 28, 28, 40, 48, 48]


def test_a_line_spanning_many_reads_is_cut_in_time_linear_in_its_length(tmp_path, monkeypatch):
    # 16,384 reads of one 4 MiB line: joining the unfinished line to every read took
    # ~16 s of CPU here (quadratic); once per line it is ~0.02 s.
    monkeypatch.setattr(sources, "_READ_BYTES", 256)
    path = tmp_path / "long.jsonl"
    long_line = json.dumps({"text": "x" * (4 << 20)}).encode()
    path.write_bytes(long_line + b"\n" + b'{"text": "y"}')
    start = time.process_time()
    batches = list(sources.iter_batches(path))
    assert time.process_time() - start < 3.0
    assert [item for batch in batches for item in batch.items] == [long_line, b'{"text": "y"}']


def test_a_utf8_byte_order_mark_at_the_start_of_a_file_is_not_a_bad_line(tmp_path, tokenizer):
    path = tmp_path / "bom.jsonl"
    # The second BOM: two such files joined with `cat` (or zstd frames of them).
    path.write_bytes(b'\xef\xbb\xbf{"text": "x = 1"}\n\xef\xbb\xbf{"text": "y"}\n')
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    assert (summary.num_documents, summary.num_bad_lines) == (2, 0)
    assert (
        IndexedDataset(tmp_path / "out" / "bom")[0].tolist() == _expected(tokenizer, ["x = 1"])[0]
    )


def test_cli_progress_shows_throughput_in_bytes_documents_and_tokens(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "p.jsonl", _documents(20_000))
    argv = ["build", str(path), "--tokenizer", str(default_tokenizer_path())]
    assert main([*argv, "--output", str(tmp_path / "out"), "--workers", "0"]) == 0
    err = capsys.readouterr().err
    assert "B/s" in err and "docs/s" in err and "tok/s" in err and "100%" in err


def test_a_number_too_long_for_int_in_another_field_does_not_stop_the_build(tmp_path, tokenizer):
    path = tmp_path / "big.jsonl"
    big = "7" * 5000  # int() refuses more than 4300 digits
    lines = ['{"text": "a"}', f'{{"text": "b", "id": {big}}}', f'{{"id": {big}, "text": }}',
             '{"text": "c"}']  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    summary = build_corpus([path], default_tokenizer_path(), tmp_path / "out", workers=0,
                           progress=False)  # fmt: skip
    assert [str(b) for b in summary.bad_lines] == [
        f"{path}:3: malformed JSON (Expecting value at column 5018)"
    ]
    shard = IndexedDataset(tmp_path / "out" / "big")
    assert [shard[i].tolist() for i in range(len(shard))] == _expected(tokenizer, ["a", "b", "c"])


@pytest.mark.parametrize("where", ["opening the index", "after the writer, before the shard"])
def test_an_interrupt_while_a_shard_is_opened_leaves_no_temporaries(tmp_path, monkeypatch, where):
    # Ctrl-C can land between any two bytecodes: while the writer creates its files, or
    # after it returned and before the build holds it (CI saw `in.idx.tmp` left).
    import builtins

    import mt_data.build as build

    path = _write_jsonl(tmp_path / "in.jsonl", _documents(50))
    if where == "opening the index":
        real_open = builtins.open

        def interrupted_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if str(file).endswith(".idx.tmp"):
                f.close()
                raise KeyboardInterrupt  # the file exists, the writer never got it
            return f

        monkeypatch.setattr(builtins, "open", interrupted_open)
    else:

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(build, "_OpenShard", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build_corpus([path], default_tokenizer_path(), out, workers=0, progress=False)
    assert sorted(p.name for p in out.glob("*") if ".tmp" in p.name) == []


def test_inspect_decodes_only_the_shown_start_of_a_long_document(tmp_path, monkeypatch):
    import mt_data.inspection
    from mt_data import IndexedDatasetWriter
    from mt_data.tokenizer import read_tokenizer

    plain, _ = read_tokenizer(default_tokenizer_path())
    ids = plain.encode("".join(f"value_{i} = 'é{i}'\n" for i in range(20_000))).ids
    with IndexedDatasetWriter(tmp_path / "book", np.uint16) as writer:
        writer.add_document(ids)  # one document of ~200k tokens, say a book
    decoded: list[int] = []

    class Spy:
        def decode(self, tokens, **kwargs):
            decoded.append(len(tokens))
            return plain.decode(tokens, **kwargs)

    monkeypatch.setattr(mt_data.inspection, "read_tokenizer", lambda path: (Spy(), path))
    for characters in (0, 1, 50, 3000):
        decoded.clear()
        report = inspect_corpus(tmp_path / "book", tokenizer="x", characters=characters)
        full = plain.decode(ids, skip_special_tokens=False)
        assert report.endswith(f"sequence 0: {len(ids)} tokens ---\n{full[:characters]}...")
        assert sum(decoded) <= 4 * characters + 64  # was every token of the document
