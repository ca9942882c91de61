"""Tokenize JSON Lines (and Parquet) files into a corpus directory of Megatron indexed shards.

`build_corpus` turns each input file into one shard `<output>/<stem>.bin/.idx`, documents
in input order, EOS appended to each, then writes `manifest.json` last.

Work is shared below file granularity: the main process cuts every file into batches of
about 256 KiB (`mt_data.sources`), worker processes parse and tokenize them
(`mt_data.encode`), and the main process writes the results in submission order, so the
output is byte-identical for any number of workers, and one huge file keeps every worker
busy. At most `2 * workers + 2` batches are in flight, so memory does not grow with the
size of a file or of the corpus.

Resume: every shard is written under a temporary name and renamed when complete
(`IndexedDatasetWriter`); just before that, its counts and its input's path, size and
modification time go to `.mt-data/<name>.json`. A rerun skips the shards that are
complete (both files, a clean index and the record) and whose input is unchanged, and
rebuilds the others, so the final directory is byte-identical to an uninterrupted
build's.

One build at a time writes a directory (an exclusive `flock` on it, where the file
system supports one); holding it, a build first removes the temporary files a killed
build left there. Without it (NFS, Lustre without flock), its temporaries have names of
their own, so that two builds at once never write one file, and it removes only those
untouched for an hour. When a build rewrites a
shard the old manifest lists, it removes that manifest first, so readers refuse the
directory until the new one is written; a build that only adds shards leaves the old
corpus readable. Shards of earlier builds
that the new manifest no longer lists are removed, with their records, after it is
written.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import re
import secrets
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Literal

from mt_data.encode import EncodedBatch, encode_batch, init_worker, worker_encode_batch
from mt_data.indexed import IndexedDatasetWriter, fsync_directory, token_dtype
from mt_data.manifest import (
    MANIFEST_NAME,
    RECORD_DIR,
    corpus_manifest,
    file_sha256,
    read_manifest,
    read_shard_record,
    write_manifest,
    write_shard_record,
)
from mt_data.progress import BuildProgress
from mt_data.shards import BuildSummary, ShardSummary, finished_shard, shard_names
from mt_data.sources import RawBatch, ReadFailure, check_readers, iter_batches, resolve_inputs
from mt_data.tokenizer import LoadedTokenizer, TokenizerSpec, load_tokenizer

__all__ = ["BuildSummary", "CorpusError", "ShardSummary", "build_corpus", "build_documents"]

OnError = Literal["skip", "fail"]
# Temporaries of a build: `<shard>.bin`/`.idx`/`manifest.json` (`<shard>.json` in the
# record directory) + `.tmp`, or + `.<pid>-<random>.tmp` for a build without the lock.
TEMP_SUFFIX = r"(\.\d+-[0-9a-f]{8})?\.tmp"
_PARTIAL_FILE = re.compile(rf"(.+\.(bin|idx)|{re.escape(MANIFEST_NAME)}){TEMP_SUFFIX}", re.DOTALL)
_PARTIAL_RECORD = re.compile(rf".+\.json{TEMP_SUFFIX}", re.DOTALL)
# Without the lock, temporaries this old are taken for a killed build's: a running build
# flushes its shard's at least every minute, and writes its JSON files' within a second.
UNLOCKED_PARTIAL_SECONDS = 3600
# How often a worker checks that the main process is still alive.
_ORPHAN_POLL_SECONDS = 1.0
# Documents per in-process batch of `build_documents`.
_DOCUMENTS_PER_BATCH = 256


class CorpusError(ValueError):
    """A bad input line under `on_error="fail"`; the message names file:line."""


def default_workers(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Worker processes used when none is given: the cores this process may run on, or
    fewer when a CPU quota allows fewer (a container limited to 2 CPUs on a 128-core host
    would otherwise start 128 workers of ~80 MiB each).

    Args:
        cgroup_root: where the cgroup file systems are mounted.
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_cpu_quota(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The CPUs this process's cgroup quota allows, rounded up; None when there is none.

    cgroup v2: the smallest ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) of
    this process's cgroup and its ancestors. cgroup v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` of the ``cpu`` controller (-1 is no quota).

    Args:
        cgroup_root: where the cgroup file systems are mounted.
        proc_cgroup: this process's cgroup membership (``/proc/self/cgroup``).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path = next((line[3:] for line in lines if line.startswith("0::")), "/")
    limits = []
    directory = cgroup_root / v2_path.lstrip("/")
    for candidate in (directory, *directory.parents):
        fields = _read_fields(candidate / "cpu.max")
        if len(fields) == 2 and fields[0] != "max":
            limits.append((fields[0], fields[1]))
        if candidate == cgroup_root:
            break
    for v1 in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
        quota = _read_fields(v1 / "cpu.cfs_quota_us")
        period = _read_fields(v1 / "cpu.cfs_period_us")
        if len(quota) == 1 and len(period) == 1:
            limits.append((quota[0], period[0]))
            break
    cpus = []
    for quota, period in limits:
        try:
            quota_us, period_us = int(quota), int(period)
        except ValueError:
            continue
        if quota_us > 0 and period_us > 0:  # v1 writes -1 for no quota
            cpus.append(-(-quota_us // period_us))
    return min(cpus) if cpus else None


def _read_fields(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


@dataclass
class _OpenShard:
    """The shard being written: its writer and running counts."""

    writer: IndexedDatasetWriter
    summary: ShardSummary
    settings: dict[str, Any]
    record_dir: Path
    on_error: OnError
    source: dict[str, Any]
    temp_suffix: str

    def add(self, encoded: EncodedBatch | ReadFailure, progress: BuildProgress) -> None:
        bad_lines = [encoded.bad] if isinstance(encoded, ReadFailure) else encoded.bad_lines
        for bad in bad_lines:
            if self.on_error == "fail":
                raise CorpusError(f"{bad}; fix the input or pass --on-error skip")
            self.summary.count_bad(bad)
        if isinstance(encoded, ReadFailure):
            return
        self.writer.add_documents(encoded.tokens, encoded.lengths)
        self.summary.documents += int(encoded.lengths.size)
        self.summary.tokens += int(encoded.tokens.size)
        self.summary.empty_documents += encoded.empty_documents
        progress.add(encoded.num_bytes, int(encoded.lengths.size), int(encoded.tokens.size))

    def finish(self) -> ShardSummary:
        # The record first: a final .idx then always has one (a record without a
        # finished shard is simply rewritten by the rerun).
        write_shard_record(
            self.record_dir, self.summary, self.settings, self.source, temp_suffix=self.temp_suffix
        )
        self.writer.finalize()
        return self.summary


def _tasks(
    jobs: Sequence[tuple[Path, Path]], text_key: str, sources: dict[int, dict[str, Any]]
) -> Iterator[tuple[int, Any]]:
    """(job index, RawBatch | ReadFailure) over every job in order, then (index, None).

    Each input's fingerprint goes to `sources[index]` before its first byte is read, so a
    file that changes while (or after) it is read never matches its shard's record.
    """
    for index, (path, _) in enumerate(jobs):
        sources[index] = input_fingerprint(path)
        for item in iter_batches(path, text_key):
            yield index, item
        yield index, None


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(_ORPHAN_POLL_SECONDS)
        if os.getppid() != parent:
            os._exit(1)


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C off while worker processes start or stop; raise it when the block ends.

    Ctrl-C sends SIGINT to the whole process group; a second press, or `uv run` without a
    terminal (it forwards SIGINT to its child), sends this process another.

    - A spawned worker imports numpy, tokenizers and mt_data for up to a second before
      `_init_builder_worker` can ignore SIGINT; a Ctrl-C then printed a KeyboardInterrupt
      traceback from it. Children inherit the signal mask, so a worker started in this
      block is born with SIGINT blocked, and its initializer drops a pending one.
    - In this process (its main thread: no other gets KeyboardInterrupt), a Ctrl-C is
      held to the end of the block, so a worker is never started without the pool
      knowing it, and stopping the workers is not cut short: a worker still starting when
      this process exits finds the pool's queues gone and prints a traceback.
    """
    held: list[int] = []
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main_thread:
            signal.signal(signal.SIGINT, handler)  # runs the handler of a pending Ctrl-C first
            if held:
                signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt, once for all held


def _init_builder_worker(spec: TokenizerSpec, text_key: str, parent: int) -> None:
    # Ctrl-C goes to the whole process group; the main process handles it and stops us.
    # SIGINT arrives blocked (`_sigint_held`); ignoring it drops a Ctrl-C pressed while
    # this process was starting.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # A worker waits on a queue it also holds a write end of, so it would sleep forever
    # after `kill -9` of the main process: watch the parent (its pid passed in, since the
    # main process may already be gone when this runs) and leave with it.
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    init_worker(spec, text_key)


def input_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies an input's content for resume: resolved path, size, mtime (ns)."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextmanager
def build_lock(out: Path) -> Iterator[bool]:
    """Hold the exclusive build lock of corpus directory `out` (a `flock` on the
    directory itself, so no lock file is left behind; released if the process dies).

    Yields:
        True when the lock is held; False (after a warning) where the file system has
        no `flock`, so another build may be writing `out` too.

    Raises:
        ValueError: If another build holds it.
    """
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{out}: another mt-data build is writing this directory; wait for it to "
                "finish or choose another output directory"
            ) from None
        except OSError as e:  # NFS (flock on a read-only fd), Lustre without flock, ...
            warnings.warn(
                f"{out}: cannot lock the directory ({e}); make sure no other build writes it",
                stacklevel=3,
            )
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def remove_partial_files(out: Path, *, older_than: float | None = None) -> list[str]:
    """Remove the temporary files an interrupted build (`kill -9`, a power cut) left in
    `out`, returning their paths relative to it.

    Only names a build writes and renames away are removed: `<shard>.bin.tmp`,
    `<shard>.idx.tmp`, `manifest.json.tmp` and `.mt-data/<shard>.json.tmp`, or with
    `.<pid>-<random>.tmp` for `.tmp` (an unlocked build's); a finished file never has
    one. A rerun of the same build overwrites them anyway; these are the ones of shards
    it no longer builds. A running build's temporaries have such names too: call it
    while holding `build_lock(out)`, or pass `older_than`.

    Args:
        out: The corpus directory.
        older_than: Remove only files untouched for this many seconds (a running build
            writes its shard's files every batch); None removes them all.
    """
    partial = [
        *(p for p in out.iterdir() if _PARTIAL_FILE.fullmatch(p.name)),
        *(p for p in (out / RECORD_DIR).glob("*.tmp") if _PARTIAL_RECORD.fullmatch(p.name)),
    ]
    removed = []
    now = time.time()
    for path in partial:
        try:
            if not (path.is_file() or path.is_symlink()):
                continue
            if older_than is not None and now - path.lstat().st_mtime < older_than:
                continue
            path.unlink()
        except FileNotFoundError:  # renamed or removed by its build meanwhile
            continue
        removed.append(str(path.relative_to(out)))
    return removed


def build_temp_suffix(locked: bool) -> str:
    """What a build's temporaries end with: `.tmp` under `build_lock`, else
    `.<pid>-<random>.tmp`, as another build may write the same shards now: with names of
    their own neither truncates the other's files, and each renames a whole shard.

    Args:
        locked: Whether the build holds `build_lock` of its directory.
    """
    return ".tmp" if locked else f".{os.getpid()}-{secrets.token_hex(4)}.tmp"


def remove_stale_shards(out: Path, keep: set[str]) -> list[str]:
    """Remove the shards that an earlier build wrote into `out` (they have a build record)
    and that are not in `keep`, with their records; returns their names."""
    removed = []
    for record in sorted((out / RECORD_DIR).glob("*.json")):
        name = record.stem
        if name in keep:
            continue
        for suffix in (".idx", ".bin"):  # the index first: without it the shard is gone
            Path(f"{out / name}{suffix}").unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        removed.append(name)
    return removed


def _remove_old_index(prefix: Path) -> None:
    """Remove the `.idx` an earlier build left at `prefix` before the shard is rebuilt.

    The new build record is written before the new shard is renamed into place; were the
    old index still there, a build interrupted in between (Ctrl-C while the index is
    written, a full disk, a power cut) would leave the old shard beside a record of the
    new input, which a rerun takes for finished when the counts happen to agree.
    """
    index = Path(f"{prefix}.idx")
    if index.is_file():
        # The record directory marks an unfinished build (readers refuse the directory
        # until its manifest is written); a directory built before records existed has
        # none, and without one the remaining shards would read as a whole corpus.
        (prefix.parent / RECORD_DIR).mkdir(exist_ok=True)
        index.unlink()
        fsync_directory(prefix.parent)


def _run_jobs(
    jobs: Sequence[tuple[Path, Path]],
    spec: TokenizerSpec,
    tokenizer: LoadedTokenizer,
    settings: dict[str, Any],
    text_key: str,
    on_error: OnError,
    workers: int,
    progress: BuildProgress,
    temp_suffix: str,
) -> list[ShardSummary]:
    """Build the shards of `jobs` ((input, output prefix) pairs), in order, writing each
    through temporaries ending in `temp_suffix`."""
    executor = None
    if workers > 0 and jobs:
        executor = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_builder_worker,
            initargs=(spec, text_key, os.getpid()),
        )
        # Running before any `_sigint_held`: CPython's resource tracker blocks SIGINT while
        # it starts itself, then unblocks it whatever the mask was.
        resource_tracker.ensure_running()
    max_in_flight = 2 * workers + 2 if executor else 1
    pending: deque[tuple[int, Any]] = deque()
    summaries: list[ShardSummary] = []
    current: _OpenShard | None = None
    # The shard whose temporaries may exist: set before its writer creates them, so that
    # a Ctrl-C before `current` holds the writer still finds them.
    opening: Path | None = None
    dtype = token_dtype(tokenizer.vocab_size)
    sources: dict[int, dict[str, Any]] = {}  # input fingerprints, taken as reading starts

    def handle(index: int, value: Any) -> None:
        nonlocal current, opening
        path, prefix = jobs[index]
        if current is None:
            progress.describe(prefix.name)
            _remove_old_index(prefix)
            opening = prefix
            summary = ShardSummary(name=prefix.name, input=str(path))
            writer = IndexedDatasetWriter(prefix, dtype, temp_suffix=temp_suffix)
            current = _OpenShard(
                writer, summary, settings, prefix.parent, on_error, sources.pop(index), temp_suffix
            )
        if value is None:
            summaries.append(current.finish())
            current = opening = None
        else:
            current.add(value.result() if isinstance(value, Future) else value, progress)

    try:
        for index, item in _tasks(jobs, text_key, sources):
            if isinstance(item, RawBatch):
                path = str(jobs[index][0])
                if executor is not None:
                    with _sigint_held():  # `submit` starts the workers, as needed
                        item = executor.submit(worker_encode_batch, item, path)
                else:
                    item = encode_batch(item, tokenizer, text_key, path)
            pending.append((index, item))
            while len(pending) > max_in_flight:
                handle(*pending.popleft())
        while pending:
            handle(*pending.popleft())
    finally:
        # A second Ctrl-C must not cut stopping the workers short.
        with _sigint_held() if executor is not None else nullcontext():
            if current is not None:
                current.writer.abort()
            if opening is not None:
                _remove_shard_temporaries(opening, temp_suffix)
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
    return summaries


def _remove_shard_temporaries(prefix: Path, temp_suffix: str) -> None:
    """Delete the temporaries of shard `prefix` that this build names with `temp_suffix`."""
    for name in (f"{prefix.name}.bin", f"{prefix.name}.idx"):
        (prefix.parent / (name + temp_suffix)).unlink(missing_ok=True)
    (prefix.parent / RECORD_DIR / f"{prefix.name}.json{temp_suffix}").unlink(missing_ok=True)


def build_corpus(
    inputs: Sequence[str | os.PathLike[str]],
    tokenizer: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    text_key: str = "text",
    on_error: OnError = "skip",
    workers: int | None = None,
    eos_token: str | None = None,
    bos: bool | str = False,
    progress: bool = True,
) -> BuildSummary:
    """Tokenize input files into a corpus directory, one shard per input file.

    Args:
        inputs: Files, directories or glob patterns of `.jsonl`, `.jsonl.zst`,
            `.jsonl.zstd` and (with pyarrow installed) `.parquet`.
        tokenizer: A tokenizer.json, or a directory holding tokenizer.json (and a
            tokenizer_config.json or special_tokens_map.json naming `eos_token`; see
            `load_tokenizer` for where else EOS is looked for).
        output: The corpus directory; created if missing. Shards already complete in it
            are kept, so rerunning an interrupted build resumes it.
        text_key: The JSON field (Parquet column) holding each document's text.
        on_error: "skip" counts bad lines and reports them with file:line; "fail"
            raises `CorpusError` at the first one, leaving that shard unwritten.
        workers: Tokenizer worker processes; None uses `default_workers()`, 0 works in
            this process (with the tokenizer's own threads). The output does not depend
            on it.
        eos_token: EOS token text, overriding the tokenizer's files.
        bos: Prepend BOS to each document: False, True (the files' `bos_token`), or its text.
        progress: Show a progress bar (MB/s, ETA, documents/s, tokens/s) on stderr.

    Returns:
        Counts per shard, bad-line examples and the wall time.

    Raises:
        ValueError: On bad arguments or inputs; `CorpusError` (a ValueError) on a bad
            line when `on_error="fail"`; if `output` already holds a corpus built with
            other settings.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error ({on_error!r}) must be 'skip' or 'fail'")
    if not isinstance(text_key, str) or not text_key:
        raise ValueError(f"text_key ({text_key!r}) must be a non-empty string")
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers ({workers!r}) must be an integer >= 0 (0: no worker process)")
    start = time.perf_counter()
    spec = TokenizerSpec(str(Path(tokenizer).expanduser().resolve()), eos_token, bos)
    loaded = load_tokenizer(spec.path, eos_token=eos_token, bos=bos)
    files = resolve_inputs(inputs)
    check_readers(files)
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; choose another path")
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "tokenizer_sha256": file_sha256(loaded.path),
        "eos_id": loaded.eos_id,
        "bos_id": loaded.bos_id,
        "text_key": text_key,
    }
    with build_lock(out) as locked:
        previous = check_tokenizer(out, settings["tokenizer_sha256"], loaded.path)
        names = shard_names(files)
        done: dict[int, ShardSummary] = {}
        jobs: list[tuple[Path, Path]] = []
        for i, (path, name) in enumerate(zip(files, names, strict=True)):
            summary = finished_shard(
                out / name, read_shard_record(out, name), settings,
                token_dtype(loaded.vocab_size), input_fingerprint(path),
            )  # fmt: skip
            if summary is not None and on_error == "fail" and summary.bad_line_examples:
                # Complete, but built under "skip": reusing it would let a build that must
                # stop at a bad line succeed. Nothing in the directory is touched.
                raise CorpusError(
                    f"{summary.bad_line_examples[0]} (skipped when shard {name} was built, "
                    f"{summary.bad_lines} bad lines in all); fix the input or pass "
                    "--on-error skip"
                )
            if summary is not None:
                done[i] = summary
            else:
                jobs.append((path, out / name))
        # Only now, so that a refused build changes nothing. Without the lock, recent ones
        # may be another build's files in progress.
        remove_partial_files(out, older_than=None if locked else UNLOCKED_PARTIAL_SECONDS)
        if _listed_shards(previous) & {prefix.name for _, prefix in jobs}:
            # A shard the manifest lists will be rewritten: until the new manifest the
            # directory is an unfinished build (readers refuse it). Otherwise the old
            # corpus stays readable while new shards are added, and after a failure.
            (out / MANIFEST_NAME).unlink(missing_ok=True)
        total_bytes = sum(path.stat().st_size for path, _ in jobs)
        temp_suffix = build_temp_suffix(locked)
        with BuildProgress(total_bytes, progress) as bar:
            built = iter(
                _run_jobs(
                    jobs, spec, loaded, settings, text_key, on_error, workers, bar, temp_suffix
                )
            )
        shards = [done[i] if i in done else next(built) for i in range(len(files))]
        manifest = corpus_manifest(
            loaded, shards, text_key=text_key, inputs=[str(f) for f in files], source="files"
        )
        write_manifest(out, manifest, temp_suffix=temp_suffix)
        removed = remove_stale_shards(out, set(names))  # only once the new corpus stands
    return BuildSummary(
        output=out, shards=shards, seconds=time.perf_counter() - start, removed=removed
    )


def _listed_shards(manifest: dict[str, Any] | None) -> set[str]:
    """The shard names a manifest lists (none without one)."""
    shards = (manifest or {}).get("shards", [])
    return {str(s.get("name")) for s in shards if isinstance(s, dict)}


def check_tokenizer(out: Path, tokenizer_sha256: str, tokenizer: Path) -> dict[str, Any] | None:
    """Refuse to build into a corpus directory made with another tokenizer.

    Returns:
        The directory's manifest, or None.

    Raises:
        ValueError: If `out`'s manifest names a tokenizer with other bytes.
    """
    previous = read_manifest(out)
    if previous is not None and previous.get("tokenizer_sha256") != tokenizer_sha256:
        raise ValueError(
            f"{out / MANIFEST_NAME}: this directory holds a corpus built with tokenizer "
            f"{previous.get('tokenizer')}, not {tokenizer}; choose a new output directory"
        )
    return previous


def build_documents(
    documents: Iterable[str],
    tokenizer: str | Path | LoadedTokenizer,
    output_prefix: str | Path,
    *,
    progress: bool = False,
    temp_suffix: str = ".tmp",
) -> ShardSummary:
    """Tokenize in-memory documents into one shard (`<output_prefix>.bin/.idx`), in-process.

    Empty documents are skipped and counted; EOS is appended to every other one.

    Args:
        documents: Document texts, in the order they are written.
        tokenizer: A tokenizer.json, a directory holding one, or a loaded tokenizer.
        output_prefix: Shard path without extension; its directory must exist.
        progress: Show a progress bar.
        temp_suffix: Ends the temporaries' names (`IndexedDatasetWriter`'s
            `temp_suffix`); `build_temp_suffix` gives one.

    Returns:
        What the shard holds.
    """
    if not isinstance(tokenizer, LoadedTokenizer):
        tokenizer = load_tokenizer(tokenizer)
    prefix = Path(output_prefix)
    summary = ShardSummary(name=prefix.name, input=None)

    def batches() -> Iterator[RawBatch]:
        batch: list[str] = []
        for text in documents:
            batch.append(text)
            if len(batch) == _DOCUMENTS_PER_BATCH:
                yield RawBatch(1, batch, "text", sum(len(t) for t in batch))
                batch = []
        if batch:
            yield RawBatch(1, batch, "text", sum(len(t) for t in batch))

    with (
        BuildProgress(0, progress) as bar,
        IndexedDatasetWriter(
            prefix, token_dtype(tokenizer.vocab_size), temp_suffix=temp_suffix
        ) as writer,
    ):
        bar.describe(prefix.name)
        for raw in batches():
            encoded = encode_batch(raw, tokenizer, "text", "<documents>")
            if encoded.bad_lines:
                raise ValueError(f"build_documents: {encoded.bad_lines[0].reason}")
            writer.add_documents(encoded.tokens, encoded.lengths)
            summary.documents += int(encoded.lengths.size)
            summary.tokens += int(encoded.tokens.size)
            summary.empty_documents += encoded.empty_documents
            bar.add(encoded.num_bytes, int(encoded.lengths.size), int(encoded.tokens.size))
    return summary
