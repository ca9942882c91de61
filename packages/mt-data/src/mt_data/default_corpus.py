"""The embedded default corpus: this Python's standard library, with a small BPE tokenizer.

It lets `mt-train pretrain` run on a fresh machine with no network: the documents are the
running interpreter's standard library `.py` files, the tokenizer is a byte-level BPE
(vocabulary 4096 plus `<|endoftext|>`) shipped in `mt_data/assets/`, trained on those
sources by `tools/train_default_tokenizer.py`.

`default_corpus_dir()` builds the corpus once into a cache directory named after the
Python version and a hash of the tokenizer and file list, in a temporary directory that
is renamed when complete; a directory holding `manifest.json` is complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mt_data.build import (
    TEMP_SUFFIX,
    UNLOCKED_PARTIAL_SECONDS,
    build_documents,
    build_lock,
    build_temp_suffix,
    check_tokenizer,
    remove_partial_files,
)
from mt_data.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    corpus_manifest,
    file_sha256,
    read_manifest,
    write_manifest,
)
from mt_data.tokenizer import load_tokenizer

__all__ = [
    "EXCLUDED_DIRECTORIES",
    "build_default_corpus",
    "default_corpus_dir",
    "default_document_paths",
    "default_tokenizer_path",
    "iter_default_documents",
]

_ASSETS = Path(__file__).parent / "assets"
DEFAULT_SHARD_NAME = "stdlib"
# The manifest's `source` of a default corpus, and every name `build_default_corpus` writes
# into its output (the shard and the manifest, each also with a build's temporary suffix,
# locked or not): the only names it may replace.
_DEFAULT_SOURCE = "python-stdlib"
_DEFAULT_CORPUS_NAME = re.compile(
    rf"({DEFAULT_SHARD_NAME}\.(bin|idx)|{re.escape(MANIFEST_NAME)})({TEMP_SUFFIX})?"
)
# A default build's temporary directory (`.<final name>.tmp-<random>`) no build holds the
# lock of and untouched this long is a killed build's. The age covers the moment between
# its creation and `build_lock`; a build takes seconds.
_ABANDONED_AFTER_SECONDS = 600
# Directories skipped anywhere below the standard library root: third-party code,
# test suites (large and full of deliberately odd code), tools not worth learning, and
# generated data rather than code: `encodings` (1.4 MB of codec tables) and `pydoc_data`
# (one 0.76 MB file of help text, which alone kept one core busy for seconds). Dropping
# those two cut the build on 2 cores from 8-17 s to about 6-12 s (the machine is shared).
EXCLUDED_DIRECTORIES = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "encodings",
        "pydoc_data",
    }
)


def default_tokenizer_path() -> Path:
    """The byte-level BPE tokenizer.json shipped with mt-data (EOS `<|endoftext|>`).

    Its directory also holds a tokenizer_config.json naming the EOS token, so the
    directory works as a tokenizer argument too.

    Returns:
        Path of the packaged tokenizer.json.
    """
    return _ASSETS / "tokenizer.json"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_document_paths() -> list[Path]:
    """The standard library `.py` files of the default corpus, sorted by relative path.

    Returns:
        Absolute paths, excluding `EXCLUDED_DIRECTORIES` at any depth.
    """
    root = _stdlib_root()
    relative: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        # Prune in place so os.walk never descends into site-packages or test suites.
        subdirectories[:] = [d for d in subdirectories if d not in EXCLUDED_DIRECTORIES]
        base = Path(directory).relative_to(root)
        relative.extend((base / f).as_posix() for f in files if f.endswith(".py"))
    return [root / r for r in sorted(relative)]


def iter_default_documents() -> Iterator[str]:
    """The default corpus's documents: one per standard library `.py` file.

    Files are read in `default_document_paths()` order; files that do not decode as
    UTF-8 (or cannot be read) are skipped.

    Yields:
        Each file's text.
    """
    for path in default_document_paths():
        try:
            yield path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def _corpus_key() -> str:
    """Short hash of the tokenizer bytes, the manifest layout and the (path, size) file list."""
    digest = hashlib.sha256(default_tokenizer_path().read_bytes())
    digest.update(f"manifest-{MANIFEST_VERSION}".encode())  # a new layout rebuilds the cache
    root = _stdlib_root()
    for path in default_document_paths():
        digest.update(f"\0{path.relative_to(root).as_posix()}\0{path.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def _check_replaceable(out: Path) -> None:
    """Refuse an output directory holding anything an earlier default build did not write.

    Raises:
        ValueError: If `out` holds other files (say the shards of `mt-data build`), or its
            manifest describes a corpus other than the default one.
    """
    foreign = sorted(p.name for p in out.iterdir() if not _DEFAULT_CORPUS_NAME.fullmatch(p.name))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        shown = ", ".join(foreign[:5]) + more
        raise ValueError(
            f"output {out} holds {shown}, which build-default did not write; it replaces only "
            "an earlier default corpus and deletes nothing else: choose a new or empty output "
            "directory (or move those files away)"
        )
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("source") != _DEFAULT_SOURCE:
        raise ValueError(
            f"{out / MANIFEST_NAME}: this directory holds a corpus that is not the default "
            "corpus (built by mt-data build?); choose a new or empty output directory"
        )


def build_default_corpus(output: str | Path, *, progress: bool = False) -> Path:
    """Tokenize the default corpus into `output` (one shard plus manifest.json).

    Args:
        output: The corpus directory; created if missing. It must be empty or hold only
            an earlier default corpus (complete or interrupted), which is replaced: its
            manifest is removed first, the new shard written atomically, the manifest
            last. Any other file there is an error, and nothing is deleted.
        progress: Show a tqdm progress bar.

    Returns:
        The corpus directory.

    Raises:
        ValueError: If `output` holds files an earlier default build did not write (say
            the shards of `mt-data build`), a corpus made with another tokenizer, or
            another build is writing it.
    """
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; choose another path")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(default_tokenizer_path())
    with build_lock(out) as locked:
        check_tokenizer(out, file_sha256(tokenizer.path), tokenizer.path)
        _check_replaceable(out)
        # Without the lock, recent temporaries may be another build's in progress.
        remove_partial_files(out, older_than=None if locked else UNLOCKED_PARTIAL_SECONDS)
        (out / MANIFEST_NAME).unlink(missing_ok=True)  # its stdlib shard is rewritten
        temp_suffix = build_temp_suffix(locked)
        shard = build_documents(
            iter_default_documents(),
            tokenizer,
            out / DEFAULT_SHARD_NAME,
            progress=progress,
            temp_suffix=temp_suffix,
        )
        shard.input = str(_stdlib_root())
        manifest = corpus_manifest(
            tokenizer,
            [shard],
            source=_DEFAULT_SOURCE,
            python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
        )
        write_manifest(out, manifest, temp_suffix=temp_suffix)
    return out


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moetrain"


def default_corpus_dir(
    cache_dir: str | Path | None = None,
    *,
    on_build: Callable[[Path], None] | None = None,
) -> Path:
    """The default corpus directory, built on first use (7-15 s on 2 cores) and cached.

    The corpus lives in `<cache>/corpus/stdlib-py<major.minor>-<hash>`, where `<cache>` is
    `cache_dir`, else `$MT_CACHE_DIR`, else `~/.cache/moetrain`, and the hash covers the
    tokenizer and the file list. It is built in a temporary sibling directory and renamed
    into place when complete, so a crashed or concurrent build never leaves a partial
    corpus under the final name; later calls remove the temporary directories of killed
    builds.

    Args:
        cache_dir: Root of the cache; None uses `$MT_CACHE_DIR` or `~/.cache/moetrain`.
        on_build: Called with the corpus directory just before a build starts (not when
            the corpus is cached), say to tell the user what the wait is for.

    Returns:
        The corpus directory (holding `stdlib.bin`, `stdlib.idx`, `manifest.json`).
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    parent = _cache_root(cache_dir) / "corpus"
    final = parent / f"stdlib-py{version}-{_corpus_key()}"
    _remove_abandoned_builds(parent)
    if (final / MANIFEST_NAME).is_file():
        return final
    if on_build is not None:
        on_build(final)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        build_default_corpus(tmp)
        if final.exists() and not (final / MANIFEST_NAME).is_file():
            shutil.rmtree(final, ignore_errors=True)  # debris without a manifest: not a corpus
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST_NAME).is_file():  # not a concurrent winner: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_abandoned_builds(parent: Path) -> None:
    """Remove the temporary directories of default builds killed (`kill -9`, a power cut)
    before they were renamed into place: each holds a partial corpus (~10 MB) and would
    stay forever. One a build holds the lock of, or touched in the last
    `_ABANDONED_AFTER_SECONDS` (`UNLOCKED_PARTIAL_SECONDS` where the file system
    has no flock), is left alone."""
    if not parent.is_dir():
        return
    for directory in parent.glob(".stdlib-py*.tmp-*"):
        try:
            age = time.time() - directory.stat().st_mtime
            if age < _ABANDONED_AFTER_SECONDS:
                continue
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # gone meanwhile (its build finished), or not a directory
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a build holds it
                continue
            except OSError:  # no flock on this file system (NFS): only the age tells
                if age < UNLOCKED_PARTIAL_SECONDS:
                    continue
            shutil.rmtree(directory, ignore_errors=True)
        finally:
            os.close(fd)
