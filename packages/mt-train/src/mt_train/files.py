"""Small file writes that a crash or power loss cannot leave torn, and the lock files that
keep two processes out of one directory."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO


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


def lock_or_holder(lock: IO[str]) -> str | None:
    """Takes an exclusive `flock` on the open lock file without waiting.

    Args:
        lock: the lock file, opened ``"a+"``.

    Returns:
        None when this process now holds it; else who holds it (the line `write_holder`
        wrote), and `lock` is closed.

    Raises:
        OSError: the file system has no `flock` (some network file systems).
    """
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "holder unknown"
        lock.close()
        return holder
    return None


def write_holder(lock: IO[str]) -> None:
    """Writes this process (pid and host) into a lock file it holds, for `lock_or_holder`."""
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
