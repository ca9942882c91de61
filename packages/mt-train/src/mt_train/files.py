"""Small file writes that a crash or power loss cannot leave torn."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_durably(path: Path, text: str) -> None:
    """Replaces `path` with `text`, whole or not at all.

    The text goes to ``<path>.tmp`` beside it, is flushed to disk, then renamed over `path`:
    a crash leaves the old file or the new one, and without the fsync before the rename a
    power loss could leave an empty file under the name. The directory is not synced: after a
    power loss the rename itself may be undone, which leaves the old file.

    Args:
        path: the file to write (replaced if it exists).
        text: its new content, written as is.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # else a power loss after the rename can leave it empty
    os.replace(tmp, path)
