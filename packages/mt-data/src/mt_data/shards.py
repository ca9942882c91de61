"""What a build produced: per-shard and whole-build summaries, shard names, resume checks."""

from __future__ import annotations

import hashlib
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mt_data.indexed import IndexedDataset
from mt_data.manifest import MANIFEST_NAME
from mt_data.sources import BadLine, input_stem

__all__ = ["MAX_REPORTED_BAD_LINES", "BuildSummary", "ShardSummary", "finished_shard"]

# At most this many bad lines per shard are kept (and printed) with file:line; all are counted.
MAX_REPORTED_BAD_LINES = 100
# The options of `mt-data build` that decide each build setting a shard records.
_SETTING_OPTIONS = {
    "tokenizer_sha256": "--tokenizer",
    "eos_id": "--eos-token",
    "bos_id": "--bos, --bos-token",
    "text_key": "--text-key",
}


@dataclass
class ShardSummary:
    """What one shard holds.

    Attributes:
        name: Shard name (`<output>/<name>.bin` and `.idx`).
        input: The input file, or None for documents not read from a file.
        documents: Documents written (empty documents and bad lines excluded).
        tokens: Tokens written, EOS (and BOS) included.
        bad_lines: Lines skipped as bad input.
        bad_lines_by_kind: Bad lines per kind (`malformed_json`, `invalid_utf8`, ...).
        empty_documents: Empty documents skipped.
        resumed: True when the shard was already complete and was not rebuilt.
        bad_line_examples: The first `MAX_REPORTED_BAD_LINES` bad lines, with file:line.
    """

    name: str
    input: str | None
    documents: int = 0
    tokens: int = 0
    bad_lines: int = 0
    bad_lines_by_kind: dict[str, int] = field(default_factory=dict)
    empty_documents: int = 0
    resumed: bool = False
    bad_line_examples: list[BadLine] = field(default_factory=list, repr=False)

    def count_bad(self, bad: BadLine) -> None:
        """Count one bad line (and keep it if fewer than the limit are kept).

        Args:
            bad: The bad line.
        """
        self.bad_lines += 1
        self.bad_lines_by_kind[bad.kind] = self.bad_lines_by_kind.get(bad.kind, 0) + 1
        if len(self.bad_line_examples) < MAX_REPORTED_BAD_LINES:
            self.bad_line_examples.append(bad)

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON-serializable data (without `resumed`)."""
        return {
            "name": self.name,
            "input": self.input,
            "documents": self.documents,
            "tokens": self.tokens,
            "bad_lines": self.bad_lines,
            "bad_lines_by_kind": dict(sorted(self.bad_lines_by_kind.items())),
            "empty_documents": self.empty_documents,
            "bad_line_examples": [
                [b.path, b.line, b.kind, b.reason] for b in self.bad_line_examples
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, resumed: bool = False) -> ShardSummary:
        """Read back `to_json()`.

        Args:
            data: A dict from `to_json()`.
            resumed: Value of the `resumed` flag.

        Returns:
            The summary.
        """
        examples = [BadLine(*item) for item in data.get("bad_line_examples", [])]
        return cls(
            name=data["name"],
            input=data["input"],
            documents=int(data["documents"]),
            tokens=int(data["tokens"]),
            bad_lines=int(data["bad_lines"]),
            bad_lines_by_kind=dict(data["bad_lines_by_kind"]),
            empty_documents=int(data["empty_documents"]),
            resumed=resumed,
            bad_line_examples=examples,
        )


@dataclass
class BuildSummary:
    """The result of `build_corpus`.

    Attributes:
        output: The corpus directory.
        shards: One summary per input file, in input order.
        seconds: Wall time of the build.
        removed: Shards of earlier builds into the directory that this build no longer
            lists, removed.
    """

    output: Path
    shards: list[ShardSummary]
    seconds: float
    removed: list[str] = field(default_factory=list)

    @property
    def num_documents(self) -> int:
        """Documents in the corpus."""
        return sum(s.documents for s in self.shards)

    @property
    def num_tokens(self) -> int:
        """Tokens in the corpus, EOS included."""
        return sum(s.tokens for s in self.shards)

    @property
    def num_bad_lines(self) -> int:
        """Bad input lines skipped (resumed shards included)."""
        return sum(s.bad_lines for s in self.shards)

    @property
    def bad_lines_by_kind(self) -> dict[str, int]:
        """Bad input lines per kind, over all shards."""
        kinds: dict[str, int] = {}
        for s in self.shards:
            for kind, n in s.bad_lines_by_kind.items():
                kinds[kind] = kinds.get(kind, 0) + n
        return dict(sorted(kinds.items()))

    @property
    def num_empty_documents(self) -> int:
        """Empty documents skipped."""
        return sum(s.empty_documents for s in self.shards)

    @property
    def num_resumed(self) -> int:
        """Shards found complete and not rebuilt."""
        return sum(s.resumed for s in self.shards)

    @property
    def bad_lines(self) -> list[BadLine]:
        """The first `MAX_REPORTED_BAD_LINES` bad lines, with file and line."""
        examples = [b for s in self.shards for b in s.bad_line_examples]
        return examples[:MAX_REPORTED_BAD_LINES]

    @property
    def manifest_path(self) -> Path:
        """The corpus's manifest.json."""
        return self.output / MANIFEST_NAME


def shard_names(files: Sequence[Path]) -> list[str]:
    """`<stem>` per file; stems shared by several inputs (ignoring case and Unicode
    normalization) get a hash of the full path, and a file without a stem (`.jsonl`) is
    named by its whole file name.

    Args:
        files: Input files.

    Returns:
        One shard name per file.
    """
    # A file named `.jsonl` has no stem; "" or "." would name the output directory itself.
    stems = [input_stem(f) if input_stem(f).strip(".") else f.name for f in files]
    # Stems are compared ignoring case and Unicode normalization: on macOS and Windows file
    # systems `Part.bin` and `part.bin` are one file, and the second shard overwrote the first.
    folded = [unicodedata.normalize("NFD", stem.casefold()) for stem in stems]
    counts: dict[str, int] = {}
    for key in folded:
        counts[key] = counts.get(key, 0) + 1
    return [
        # os.fsencode: a file name that is not UTF-8 holds surrogates str.encode() refuses.
        stem
        if counts[key] == 1
        else f"{stem}-{hashlib.sha1(os.fsencode(f)).hexdigest()[:8]}"
        for stem, key, f in zip(stems, folded, files, strict=True)
    ]


def finished_shard(
    prefix: Path,
    record: dict[str, Any] | None,
    settings: dict[str, Any],
    dtype: np.dtype,
    source: dict[str, Any],
) -> ShardSummary | None:
    """The summary of the shard at `prefix` if it is complete, else None (rebuild it).

    Complete means: both final files exist, the index reads cleanly with the expected
    dtype, its build record matches the shard's counts, and the record's input
    fingerprint equals `source` (same file, size and modification time).

    Args:
        prefix: Shard path without extension.
        record: Its build record (`read_shard_record`), or None.
        settings: The build's settings (tokenizer hash, EOS/BOS ids, text key).
        dtype: The token dtype the build writes.
        source: The input's fingerprint now (`mt_data.build.input_fingerprint`).

    Returns:
        The recorded summary with `resumed=True`, or None.

    Raises:
        ValueError: If the shard is complete but was built with other settings.
    """
    if record is None or not (Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()):
        return None
    if record.get("source") != source:
        return None  # another input file, or this one changed since: rebuild it
    try:
        shard = IndexedDataset(prefix)
    except ValueError:
        return None  # torn or foreign: rebuild it
    summary = ShardSummary.from_json(record["summary"], resumed=True)
    if shard.dtype != dtype or (len(shard), shard.num_tokens) != (
        summary.documents,
        summary.tokens,
    ):
        return None
    built = record.get("settings")
    if built != settings:
        built = built if isinstance(built, dict) else {}
        changed = [key for key in settings if built.get(key) != settings[key]]
        differences = "; ".join(
            f"{key} {built.get(key)!r} ({_SETTING_OPTIONS.get(key, key)}), this build "
            f"{settings[key]!r}"
            for key in changed
        )
        raise ValueError(
            f"{prefix}.idx was built with other settings: {differences or built}; pass the "
            "settings it was built with to resume that build, or choose a new output directory"
        )
    return summary
