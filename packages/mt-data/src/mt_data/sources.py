"""Find input files and cut them into batches of raw documents for the tokenizer workers.

Inputs are JSON Lines, plain (`.jsonl`) or zstandard-compressed (`.jsonl.zst`,
`.jsonl.zstd`, one or several frames), and optionally Parquet (`.parquet`, needs
`pip install mt-data[parquet]`). The main process only reads and splits: a file becomes a
sequence of `RawBatch`es of about `BATCH_BYTES` (256 KiB) each, cut at line (or row-group batch)
boundaries that depend on the data alone, never on the number of workers. Parsing JSON
and tokenizing happen in the workers (`mt_data.encode`).

A file that cannot be read to its end (corrupt or truncated zstandard data, an unreadable
Parquet file) ends its batches with a `ReadFailure` naming the line where reading stopped.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import zstandard

__all__ = [
    "BATCH_BYTES",
    "INPUT_SUFFIXES",
    "JSONL_SUFFIXES",
    "BadLine",
    "RawBatch",
    "ReadFailure",
    "check_readers",
    "input_stem",
    "iter_batches",
    "resolve_inputs",
]

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.zstd")
PARQUET_SUFFIXES = (".parquet",)
INPUT_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
# One worker task. Small enough that the last batches of a build leave no core idle for
# long (the default BPE tokenizes ~0.8 MB/s per core here, so 256 KiB is ~0.3 s of work,
# against ~1 ms of pickling and IPC per task), large enough for `encode_batch_fast`.
BATCH_BYTES = 256 << 10
# Reads of plain files; zstd files are read a quarter as much at a time, since their
# chunks decompress to several times their size. Batches are cut between reads.
_READ_BYTES = 64 << 10
# Rows per Parquet record batch (texts are usually ~KBs, so ~256 KiB-1 MiB per batch).
_PARQUET_ROWS = 256
_GLOB_CHARS = set("*?[")
# Largest zstd window accepted, zstd's own maximum: files made with `zstd --long=31` are
# valid, but the library's default limit (128 MiB) called them corrupt. The window is
# allocated only when a frame asks for it.
_ZSTD_MAX_WINDOW = 1 << 31


@dataclass(frozen=True)
class BadLine:
    """An input line (or Parquet row) that could not become a document.

    Attributes:
        path: The input file.
        line: 1-based line number (row number for Parquet).
        kind: One of `malformed_json`, `not_an_object`, `missing_text`,
            `non_string_text`, `invalid_utf8`, `corrupt_input`.
        reason: What is wrong with it, for a person.
    """

    path: str
    line: int
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class RawBatch:
    """Consecutive documents of one file, not yet parsed.

    Attributes:
        first_line: 1-based line (row) number of `items[0]`.
        items: Raw JSON lines (`kind="jsonl"`, bytes without the newline) or document
            texts (`kind="text"`, str, or None for a missing value).
        kind: How the worker turns an item into a document.
        num_bytes: Input bytes this batch accounts for (for MB/s and ETA).
    """

    first_line: int
    items: list
    kind: Literal["jsonl", "text"]
    num_bytes: int


@dataclass(frozen=True)
class ReadFailure:
    """Reading a file stopped early; documents before `line` were delivered.

    Attributes:
        bad: The failure as a bad line of kind `corrupt_input`.
    """

    bad: BadLine


def input_kind(path: str | Path) -> str | None:
    """`"jsonl"`, `"parquet"`, or None for an unsupported file name (suffixes in any case:
    `a.JSONL`, `a.jsonl.ZST`, `a.PARQUET`)."""
    name = Path(path).name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def input_stem(path: str | Path) -> str:
    """The file name without its input suffix (`a/b.jsonl.zst` -> `b`).

    Args:
        path: An input file.

    Returns:
        The name the file's shard is built from.
    """
    name = Path(path).name
    for suffix in sorted(INPUT_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand files, directories and glob patterns into a list of input files.

    A directory contributes every `.jsonl`, `.jsonl.zst`, `.jsonl.zstd` and `.parquet`
    file below it (suffixes in any case), sorted by path; a glob pattern contributes its
    sorted matches. Duplicates are dropped; order is otherwise that of `inputs`.

    Args:
        inputs: Paths, directories or glob patterns (`data/*.jsonl.zst`, `data/**/*.jsonl`).

    Returns:
        The input files, absolute, symbolic links not resolved.

    Raises:
        ValueError: If an input does not exist, matches nothing, or has an unsupported type.
    """
    if isinstance(inputs, str | os.PathLike):
        raise ValueError(f"inputs must be a list of paths, got the single path {inputs!r}")
    if not inputs:
        raise ValueError("no inputs given; pass at least one .jsonl/.jsonl.zst file or directory")
    kinds = "/".join(INPUT_SUFFIXES)
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and input_kind(p))
            if not found:
                raise ValueError(f"input directory {path} holds no {kinds} files")
            files.extend(found)
        elif path.is_file():
            if not input_kind(path):
                raise ValueError(f"input {path}: unsupported file type; expected one of {kinds}")
            files.append(path)
        elif path.exists():  # a pipe (`<(zstdcat a.zst)`), a device, a socket
            raise ValueError(
                f"input {path}: not a regular file or directory; save the data to a "
                f"{kinds} file first (resuming a build needs its size and modification time)"
            )
        elif _GLOB_CHARS & set(str(item)):
            found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if input_kind(p))
            if not found:
                raise ValueError(f"input pattern {item!r} matches no {kinds} files")
            files.extend(found)
        else:
            raise ValueError(f"input {path}: no such file or directory")
    # Named as given, not by their resolved targets: the Hugging Face hub cache links
    # `train.jsonl.zst` to a blob named by its hash, whose name says neither the format
    # nor a useful shard name. Repeats of one file (by target) are dropped.
    unique: dict[Path, Path] = {}
    for p in files:
        unique.setdefault(p.resolve(), Path(os.path.abspath(p)))
    return list(unique.values())


class _Truncated(Exception):
    pass


def _zstd_chunks(raw, on_read) -> Iterator[bytes]:
    """Decompressed bytes of a stream of zstd frames; raises `_Truncated` at a cut frame.

    python-zstandard's `stream_reader` ends silently at a truncated frame, so frames are
    decoded with a `decompressobj` each and the end of input inside a frame is an error.
    """
    dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
    dobj = dctx.decompressobj()
    in_frame = False
    while data := raw.read(_READ_BYTES // 4):
        on_read(len(data))
        while data:
            out = dobj.decompress(data)
            in_frame = True
            if out:
                yield out
            if dobj.eof:
                data = dobj.unused_data
                dobj = dctx.decompressobj()
                in_frame = False
            else:
                data = b""
    if in_frame:
        raise _Truncated


def _plain_chunks(raw, on_read) -> Iterator[bytes]:
    while data := raw.read(_READ_BYTES):
        on_read(len(data))
        yield data


def _iter_jsonl_batches(path: Path) -> Iterator[RawBatch | ReadFailure]:
    compressed = not path.name.lower().endswith(".jsonl")
    consumed = 0  # input (file) bytes read and not yet attributed to a batch

    def on_read(n: int) -> None:
        nonlocal consumed
        consumed += n

    line = 1
    lines: list[bytes] = []
    size = 0
    # The unfinished last line, in pieces, joined once its end arrives: a line spanning
    # many reads is copied once, not once per read (which was quadratic in its length).
    carry: list[bytes] = []
    with open(path, "rb") as raw:
        chunks = (_zstd_chunks if compressed else _plain_chunks)(raw, on_read)
        try:
            for chunk in chunks:
                pieces = chunk.split(b"\n")
                if len(pieces) > 1:
                    lines.append(b"".join([*carry, pieces[0]]))
                    lines.extend(pieces[1:-1])
                    carry = []
                carry.append(pieces[-1])
                size += len(chunk)
                if size >= BATCH_BYTES:
                    yield RawBatch(line, lines, "jsonl", consumed)
                    line += len(lines)
                    lines, size, consumed = [], 0, 0
        except (zstandard.ZstdError, _Truncated) as e:
            reason = (
                "truncated zstandard data (the file ends inside a frame)"
                if isinstance(e, _Truncated)
                else f"corrupt zstandard data ({e})"
            )
            if lines:
                yield RawBatch(line, lines, "jsonl", consumed)
                line += len(lines)
            bad = BadLine(str(path), line, "corrupt_input", f"{reason}; the rest is unread")
            yield ReadFailure(bad)
            return
    if tail := b"".join(carry):
        lines.append(tail)
    if lines or consumed:
        yield RawBatch(line, lines, "jsonl", consumed)


def check_readers(files: Sequence[Path]) -> None:
    """Refuse inputs this installation cannot read before a build starts, rather than
    when it reaches them, maybe hours later.

    Args:
        files: Input files (`resolve_inputs`).

    Raises:
        ValueError: If a Parquet file is among them and pyarrow is not installed.
    """
    parquet = next((f for f in files if input_kind(f) == "parquet"), None)
    if parquet is not None:
        _import_parquet(parquet)


def _import_parquet(path: Path) -> ModuleType:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"input {path}: reading Parquet needs pyarrow; pip install 'mt-data[parquet]'"
        ) from e
    return pq


def _iter_parquet_batches(path: Path, text_key: str) -> Iterator[RawBatch | ReadFailure]:
    pq = _import_parquet(path)
    row = 1
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_key not in names:
            bad = BadLine(
                str(path), 1, "missing_text", f"no {text_key!r} column (columns: {names[:5]})"
            )
            yield ReadFailure(bad)
            return
        total_rows = max(parquet.metadata.num_rows, 1)
        file_bytes = path.stat().st_size
        for record_batch in parquet.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_key]):
            column = record_batch.column(0)
            texts = column.to_pylist()
            num_bytes = file_bytes * len(texts) // total_rows
            yield RawBatch(row, texts, "text", num_bytes)
            row += len(texts)
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these
        yield ReadFailure(BadLine(str(path), row, "corrupt_input", f"unreadable Parquet ({e})"))


def iter_batches(path: str | Path, text_key: str = "text") -> Iterator[RawBatch | ReadFailure]:
    """Cut one input file into batches of raw documents, in order.

    Args:
        path: A `.jsonl`, `.jsonl.zst`, `.jsonl.zstd` or `.parquet` file.
        text_key: The JSON field or Parquet column holding each document's text.

    Yields:
        `RawBatch`es covering the file in order, possibly ended by one `ReadFailure`.
    """
    path = Path(path)
    if input_kind(path) == "parquet":
        yield from _iter_parquet_batches(path, text_key)
    else:
        yield from _iter_jsonl_batches(path)
