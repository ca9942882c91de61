"""Find input files and read documents from JSON Lines, plain or zstandard-compressed."""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard

__all__ = ["JSONL_SUFFIXES", "BadLine", "input_stem", "iter_jsonl", "resolve_inputs"]

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.zstd")
_GLOB_CHARS = set("*?[")
_READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class BadLine:
    """A line that could not become a document.

    Attributes:
        path: The input file.
        line: 1-based line number.
        reason: What is wrong with it.
    """

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def input_stem(path: str | Path) -> str:
    """The file name without its JSON Lines suffix (`a/b.jsonl.zst` -> `b`).

    Args:
        path: An input file.

    Returns:
        The name the file's shard is built from.
    """
    name = Path(path).name
    for suffix in sorted(JSONL_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand files, directories and glob patterns into a list of JSON Lines files.

    A directory contributes every `.jsonl`, `.jsonl.zst` and `.jsonl.zstd` file below it,
    sorted by relative path; a glob pattern contributes its sorted matches. Duplicates are
    dropped; order is otherwise that of `inputs`.

    Args:
        inputs: Paths, directories or glob patterns (`data/*.jsonl.zst`, `data/**/*.jsonl`).

    Returns:
        The input files, absolute.

    Raises:
        ValueError: If an input does not exist, matches nothing, or is not JSON Lines.
    """
    if isinstance(inputs, str | os.PathLike):
        raise ValueError(f"inputs must be a list of paths, got the single path {inputs!r}")
    if not inputs:
        raise ValueError("no inputs given; pass at least one .jsonl/.jsonl.zst file or directory")
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _is_jsonl(p))
            if not found:
                raise ValueError(
                    f"input directory {path} holds no {'/'.join(JSONL_SUFFIXES)} files"
                )
            files.extend(found)
        elif path.is_file():
            if not _is_jsonl(path):
                raise ValueError(
                    f"input {path}: unsupported file type; expected one of {JSONL_SUFFIXES}"
                )
            files.append(path)
        elif _GLOB_CHARS & set(str(item)):
            found = sorted(
                Path(p) for p in glob.glob(str(path), recursive=True) if _is_jsonl(Path(p))
            )
            if not found:
                raise ValueError(
                    f"input pattern {item!r} matches no {'/'.join(JSONL_SUFFIXES)} files"
                )
            files.extend(found)
        else:
            raise ValueError(f"input {path}: no such file or directory")
    unique = dict.fromkeys(p.resolve() for p in files)
    return list(unique)


def _open_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as raw:
        if path.name.endswith(".jsonl"):
            yield from io.BufferedReader(raw, buffer_size=_READ_BUFFER_BYTES)
            return
        # read_across_frames: files concatenated from several zstd frames read as one.
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        try:
            yield from io.BufferedReader(reader, buffer_size=_READ_BUFFER_BYTES)
        except zstandard.ZstdError as e:
            raise ValueError(
                f"{path}: corrupt zstandard stream ({e}); recompress or remove the file"
            ) from e


def iter_jsonl(path: str | Path, text_key: str = "text") -> Iterator[str | BadLine]:
    """Read the documents of a JSON Lines file, in order.

    Each non-blank line must be a JSON object whose `text_key` field is a string. Blank
    lines are ignored. A line that is not UTF-8, not JSON, not an object, or lacks a
    string text field is yielded as a `BadLine` instead of a document, so the caller
    decides whether to skip it or stop.

    Args:
        path: A `.jsonl`, `.jsonl.zst` or `.jsonl.zstd` file (zstd may hold several frames).
        text_key: The field holding the document text.

    Yields:
        The document text, or a `BadLine` describing why a line has none.

    Raises:
        ValueError: If a compressed file's stream is corrupt.
    """
    path = Path(path)
    for number, raw_line in enumerate(_open_lines(path), start=1):
        if not raw_line.strip():
            continue
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadLine(str(path), number, f"invalid UTF-8 at byte {e.start}")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield BadLine(str(path), number, f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            yield BadLine(str(path), number, f"expected a JSON object, got {type(record).__name__}")
            continue
        if text_key not in record:
            keys = ", ".join(list(record)[:5])
            yield BadLine(str(path), number, f"no {text_key!r} field (fields: {keys})")
            continue
        text = record[text_key]
        if not isinstance(text, str):
            yield BadLine(
                str(path), number, f"field {text_key!r} is {type(text).__name__}, not a string"
            )
            continue
        if "\\u" in line and not _encodes_as_utf8(text):
            # JSON escapes can spell lone surrogates ("\\ud800"), which are not text.
            yield BadLine(str(path), number, f"field {text_key!r} holds a lone surrogate escape")
            continue
        yield text


def _encodes_as_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
