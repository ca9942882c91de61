"""`manifest.json`: what a corpus directory holds, written last and atomically.

A corpus directory is complete when its `manifest.json` exists: the builder writes it
after every shard is in place, through a temporary file, fsync and rename.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mt_data.indexed import fsync_directory

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "read_manifest", "write_manifest"]

MANIFEST_NAME = "manifest.json"
# Version of the manifest's layout (the shards themselves are Megatron index version 1).
MANIFEST_VERSION = 1


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json` into `directory` atomically (temp file, fsync, rename).

    Args:
        directory: The corpus directory.
        manifest: JSON-serializable description of the corpus.

    Returns:
        The manifest's path.
    """
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    tmp = directory / (MANIFEST_NAME + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(directory)
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
