"""`manifest.json` and the per-shard build records, all written atomically.

A corpus directory is complete when its `manifest.json` exists: the builder writes it
after every shard is in place, through a temporary file, fsync and rename. Each shard's
counts are also kept in `.mt-data/<name>.json`, written just before the shard is renamed
into place, so a resumed build reports (and writes into the manifest) the same counts
as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mt_data.indexed import fsync_directory, naming_file, token_dtype

if TYPE_CHECKING:
    from mt_data.shards import ShardSummary
    from mt_data.tokenizer import LoadedTokenizer

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "RECORD_DIR",
    "corpus_manifest",
    "file_sha256",
    "read_manifest",
    "read_shard_record",
    "write_manifest",
    "write_shard_record",
]

MANIFEST_NAME = "manifest.json"
# Version of the manifest's layout (the shards themselves are Megatron index version 1).
# 2: bad lines per kind, BOS, build records in .mt-data/.
MANIFEST_VERSION = 2
# Per-shard build records, hidden so that globbing the corpus directory finds only shards.
RECORD_DIR = ".mt-data"


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in chunks.

    Args:
        path: The file.

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, data: Any, temp_suffix: str) -> None:
    tmp = path.with_name(path.name + temp_suffix)
    try:
        with naming_file(tmp), open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_shard_record(
    directory: str | Path,
    summary: ShardSummary,
    settings: dict[str, Any],
    source: dict[str, Any] | None = None,
    *,
    temp_suffix: str = ".tmp",
) -> Path:
    """Write a shard's build record `.mt-data/<name>.json` atomically.

    Args:
        directory: The corpus directory.
        summary: The shard's counts.
        settings: The build settings it was made with.
        source: Its input's fingerprint (path, size, modification time), if any.
        temp_suffix: Ends the temporary file's name; one of its own for a build that
            cannot lock the directory (`IndexedDatasetWriter`'s `temp_suffix`).

    Returns:
        The record's path.
    """
    records = Path(directory) / RECORD_DIR
    records.mkdir(exist_ok=True)
    path = records / f"{summary.name}.json"
    record = {"settings": settings, "summary": summary.to_json(), "source": source}
    _write_json_atomic(path, record, temp_suffix)
    return path


def read_shard_record(directory: str | Path, name: str) -> dict[str, Any] | None:
    """A shard's build record, or None if it is missing or unreadable.

    Args:
        directory: The corpus directory.
        name: The shard name.

    Returns:
        The record (`settings`, `summary`), or None.
    """
    path = Path(directory) / RECORD_DIR / f"{name}.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = isinstance(record, dict) and {"settings", "summary"} <= set(record)
    return record if ok else None


def corpus_manifest(
    tokenizer: LoadedTokenizer, shards: Sequence[ShardSummary], **extra: Any
) -> dict[str, Any]:
    """The `manifest.json` content describing a corpus built with `tokenizer`.

    Args:
        tokenizer: The tokenizer the shards were built with.
        shards: The shards, in order.
        **extra: Further fields (say `text_key`, `inputs`, `source`).

    Returns:
        A JSON-serializable dict; it has no timestamps, so a rebuild writes the same bytes.
    """
    kinds: dict[str, int] = {}
    for s in shards:
        for kind, n in s.bad_lines_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {
        "format": "megatron-indexed",
        "format_version": MANIFEST_VERSION,
        "tokenizer": str(tokenizer.path),
        "tokenizer_sha256": file_sha256(tokenizer.path),
        "vocab_size": tokenizer.vocab_size,
        "eos_token": tokenizer.eos_token,
        "eos_id": tokenizer.eos_id,
        "bos_token": tokenizer.bos_token,
        "bos_id": tokenizer.bos_id,
        "dtype": str(token_dtype(tokenizer.vocab_size)),
        "shards": [
            {
                "name": s.name,
                "input": s.input,
                "documents": s.documents,
                "tokens": s.tokens,
                "bad_lines": s.bad_lines,
                "bad_lines_by_kind": dict(sorted(s.bad_lines_by_kind.items())),
                "empty_documents": s.empty_documents,
            }
            for s in shards
        ],
        "num_documents": sum(s.documents for s in shards),
        "num_tokens": sum(s.tokens for s in shards),
        "num_bad_lines": sum(s.bad_lines for s in shards),
        "bad_lines_by_kind": dict(sorted(kinds.items())),
        "num_empty_documents": sum(s.empty_documents for s in shards),
        **extra,
    }


def write_manifest(
    directory: str | Path, manifest: dict[str, Any], *, temp_suffix: str = ".tmp"
) -> Path:
    """Write `manifest.json` into `directory` atomically (temp file, fsync, rename).

    Args:
        directory: The corpus directory.
        manifest: JSON-serializable description of the corpus.
        temp_suffix: Ends the temporary file's name; one of its own for a build that
            cannot lock the directory (`IndexedDatasetWriter`'s `temp_suffix`).

    Returns:
        The manifest's path.
    """
    path = Path(directory) / MANIFEST_NAME
    _write_json_atomic(path, manifest, temp_suffix)
    return path


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """Read a corpus directory's `manifest.json`.

    Args:
        directory: The corpus directory.

    Returns:
        The manifest, or None if the directory has none.

    Raises:
        ValueError: If the manifest exists but is not a JSON object.
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it and rebuild") from e
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object; delete it and rebuild")
    return manifest
