"""Megatron-LM's indexed dataset format: a `.bin` token array plus an `.idx` index.

A corpus shard is two files sharing a path prefix. `<prefix>.bin` holds the tokens of
every sequence back to back, raw, in the index's dtype, native little-endian, no header.
`<prefix>.idx` describes them; all integers are little-endian:

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8  <Q     version, always 1
    17      1  <B     dtype code (table below)
    18      8  <Q     sequence count S
    26      8  <Q     document count D (= documents + 1)
    34      4·S       int32 sequence lengths, in tokens
    34+4S   8·S       int64 sequence pointers, byte offsets into `.bin`
    34+12S  8·D       int64 document indices: document k is sequences
                      [doc_idx[k], doc_idx[k+1]); the first entry is always 0

Megatron's dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
7 float32, 8 uint16. There is no uint32, so tokens are stored as uint16 when the
vocabulary has fewer than 65,500 entries and as int32 above (`token_dtype`).

moetrain writes one sequence per document, so `doc_idx` is 0, 1, ..., S and the
pointers are contiguous (`pointer[i] = itemsize · Σ length[:i]`); it reads any file
Megatron-LM or NeMo wrote.

Writes are crash-safe: `IndexedDatasetWriter` writes `<prefix>.bin.tmp` and
`<prefix>.idx.tmp`, fsyncs both, removes an older `<prefix>.idx`, renames them to their
final names (`.bin` first, `.idx` last, so a final `.idx` means a finished shard) and
fsyncs the directory. A power cut leaves the old shard, the finished one, or (replacing
a shard, between the renames) a `.bin` without `.idx`, never a torn shard that looks done.
"""

from __future__ import annotations

import errno
import os
import resource
import struct
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "fsync_directory",
    "naming_file",
    "token_dtype",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic (9) + version <Q (8) + dtype code <B (1) + sequence count <Q (8) + doc count <Q (8)
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
# A writer's files are flushed at least this often (temporaries' age, see add_documents).
_FLUSH_SECONDS = 60.0

# Megatron's threshold: vocabularies below it fit uint16 with room for a few added tokens.
_UINT16_VOCAB_LIMIT = 65500
# Documents per step when finalize derives pointers from lengths (8 MiB of int64 each).
_FINALIZE_CHUNK = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron-LM uses to store token ids of a vocabulary.

    Args:
        vocab_size: Number of token ids, including added and special tokens.

    Returns:
        `uint16` if `vocab_size < 65500`, else `int32` (the format has no uint32).

    Raises:
        ValueError: If `vocab_size` is not a positive integer.
    """
    if not isinstance(vocab_size, int | np.integer) or vocab_size <= 0:
        raise ValueError(f"vocab_size ({vocab_size!r}) must be a positive integer")
    return np.dtype(np.uint16) if vocab_size < _UINT16_VOCAB_LIMIT else np.dtype(np.int32)


# What fsync of a directory raises on file systems that do not support it (some FUSE and
# network file systems): their renames are as durable as they make them, nothing to do.
_DIRECTORY_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.ENOSYS})


def fsync_directory(path: str | Path) -> None:
    """Flush a directory entry to disk so a rename inside it survives a power cut.

    File systems that cannot fsync a directory are left as they are.

    Args:
        path: The directory whose entries (creations, renames) must be durable.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming_file(Path(path)):
            os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIRECTORY_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


@contextmanager
def naming_file(path: Path) -> Iterator[None]:
    """Add `path` to an OSError raised without a file name inside the block.

    `write`, `flush` and `fsync` on an open file raise `[Errno 28] No space left on
    device` naming no file, so the user could not tell which disk filled up.

    Args:
        path: The file the block writes.
    """
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from e


def _paths(path_prefix: str | Path) -> tuple[Path, Path]:
    prefix = os.fspath(path_prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDatasetWriter:
    """Writes one shard (`<prefix>.bin` + `<prefix>.idx`), one sequence per document.

    Use it as a context manager: leaving the block normally finalizes the shard; an
    exception that escapes it deletes the temporary files, so no finished-looking file
    is left behind.

        with IndexedDatasetWriter("out/shard", token_dtype(vocab_size)) as writer:
            for tokens in documents:
                writer.add_document(tokens)

    Memory stays bounded whatever the shard's size: tokens go straight to `<prefix>.bin.tmp`
    and the document lengths to `<prefix>.idx.tmp` (where the index keeps them), and
    `finalize` derives the pointers and document indices from them in chunks.

    Args:
        path_prefix: Output path without extension; the directory must exist.
        dtype: Token dtype, one of Megatron's (`token_dtype(vocab_size)` picks it).
        temp_suffix: Ends the temporaries' names (`<prefix>.bin<temp_suffix>`). Two
            writers of one shard must not share it: the second would truncate the first's
            files, which then renames a torn shard into place. A build holds a lock on
            its directory; one that cannot passes a suffix of its own.

    Raises:
        ValueError: If `dtype` has no Megatron dtype code or the directory is missing.
    """

    def __init__(
        self, path_prefix: str | Path, dtype: np.dtype | type | str, *, temp_suffix: str = ".tmp"
    ) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            supported = ", ".join(str(d) for d in DTYPE_CODES.values())
            raise ValueError(
                f"dtype {self.dtype} has no code in Megatron's indexed format; "
                f"use one of {supported} (token_dtype(vocab_size) picks uint16 or int32)"
            )
        self.bin_path, self.idx_path = _paths(path_prefix)
        if not self.bin_path.parent.is_dir():
            raise ValueError(
                f"output directory {self.bin_path.parent} does not exist; create it first"
            )
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + temp_suffix)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + temp_suffix)
        self._bin_file = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed in finalize/abort)
        try:
            self._idx_file = open(self._idx_tmp, "w+b")  # noqa: SIM115 (closed in finalize/abort)
        except BaseException:  # out of file descriptors, or Ctrl-C once the file exists
            self._bin_file.close()
            self._bin_tmp.unlink(missing_ok=True)
            self._idx_tmp.unlink(missing_ok=True)
            raise
        try:
            with naming_file(self._idx_tmp):
                self._idx_file.write(b"\0" * _HEADER.size)  # the header is written last
        except BaseException:
            self._remove_temporaries()
            raise
        self._num_documents = 0
        self._flushed_at = time.monotonic()
        self._done = False
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._bounds: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._bounds = None

    @property
    def num_documents(self) -> int:
        """Number of documents added so far."""
        return self._num_documents

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document as one sequence.

        Args:
            tokens: The document's token ids (EOS included if wanted); may be empty.

        Raises:
            ValueError: If a token id does not fit the writer's dtype, or the writer is
                already finalized.
        """
        array = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if array.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
        self.add_documents(array, np.array([array.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents given back to back, one sequence each.

        Args:
            tokens: 1-D token ids of all the documents, concatenated.
            lengths: 1-D tokens per document; sums to `len(tokens)`.

        Raises:
            ValueError: If the lengths do not add up, token ids are not integers, a length
                or token id does not fit the format, or the writer is already finalized.
        """
        if self._done:
            raise ValueError(f"writer for {self.idx_path} is already finalized or aborted")
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size:
            raise ValueError(
                f"lengths (sum {int(lengths.sum())}) must add up to the {tokens.size} tokens, "
                "both one-dimensional"
            )
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("document lengths must be in [0, 2**31); split longer documents")
        if tokens.size and self._bounds is not None and not np.issubdtype(tokens.dtype, np.integer):
            # astype would truncate 1.5 to 1 (and NaN to anything) without a word.
            raise ValueError(
                f"token ids must be integers, got {tokens.dtype} values; pass integer ids"
            )
        if tokens.size and self._bounds is not None:
            low, high = int(tokens.min()), int(tokens.max())
            if low < self._bounds[0] or high > self._bounds[1]:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit {self.dtype} "
                    f"(range {self._bounds}); pick the dtype with token_dtype(vocab_size)"
                )
        # Flushed at least every _FLUSH_SECONDS: a build without flock takes temporaries
        # untouched for an hour for a killed build's, and a buffer (st_blksize: 1-4 MiB on
        # NFS and Lustre, a million document lengths in the .idx) could hold a running
        # shard's writes longer. Not every call: `add_document` comes once per document.
        flush = time.monotonic() - self._flushed_at >= _FLUSH_SECONDS
        with naming_file(self._bin_tmp):
            self._bin_file.write(tokens.astype(self.dtype, copy=False).tobytes())
            if flush:
                self._bin_file.flush()
        with naming_file(self._idx_tmp):
            self._idx_file.write(lengths.astype("<i4").tobytes())
            if flush:
                self._idx_file.flush()
        if flush:
            self._flushed_at = time.monotonic()
        self._num_documents += int(lengths.size)

    def finalize(self) -> None:
        """Write the index, fsync both files, rename them into place, fsync the directory.

        Raises:
            ValueError: If the writer is already finalized or aborted.
        """
        if self._done:
            raise ValueError(f"writer for {self.idx_path} is already finalized or aborted")
        self._done = True
        try:
            with naming_file(self._bin_tmp):
                self._bin_file.flush()
                os.fsync(self._bin_file.fileno())
                self._bin_file.close()
            with naming_file(self._idx_tmp):
                self._write_index_tail()
            # .bin first, .idx last: a final .idx (with its .bin) means a finished shard.
            # An older .idx goes before its .bin is replaced: with the new .bin it would
            # read as a shard with the old document lengths.
            self.idx_path.unlink(missing_ok=True)
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
            fsync_directory(self.idx_path.parent)
        except BaseException:
            self._remove_temporaries()
            raise

    def _write_index_tail(self) -> None:
        """Append pointers and document indices after the lengths, then the header."""
        f = self._idx_file
        n = self._num_documents
        f.flush()
        offset = 0  # byte offset of the next sequence in .bin
        for first in range(0, n, _FINALIZE_CHUNK):
            count = min(_FINALIZE_CHUNK, n - first)
            f.seek(_HEADER.size + 4 * first)
            lengths = np.frombuffer(f.read(4 * count), dtype="<i4").astype(np.int64)
            pointers = np.empty(count, dtype="<i8")
            pointers[0] = offset
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            pointers[1:] += offset
            offset += int(lengths.sum()) * self.dtype.itemsize
            f.seek(0, os.SEEK_END)
            f.write(pointers.tobytes())
        for first in range(0, n + 1, _FINALIZE_CHUNK):
            count = min(_FINALIZE_CHUNK, n + 1 - first)
            f.write(np.arange(first, first + count, dtype="<i8").tobytes())
        f.seek(0)
        f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[self.dtype], n, n + 1))
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def abort(self) -> None:
        """Close and delete the temporary files; the final names are left untouched."""
        self._done = True
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for f in (self._bin_file, self._idx_file):
            with suppress(OSError):  # flushing what is buffered failed again (a full disk)
                f.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


class IndexedDataset:
    """Memory-mapped reader of one shard (`<prefix>.bin` + `<prefix>.idx`).

    Nothing is read into RAM but the index; `dataset[i]` is a view into the mapped
    `.bin` file.

    Args:
        path_prefix: Shard path without extension.

    Raises:
        FileNotFoundError: If either file is missing.
        ValueError: If the index has a bad magic, version or dtype code, an impossible
            document index, either file is truncated, or the process may open no more
            files.
    """

    def __init__(self, path_prefix: str | Path) -> None:
        self.bin_path, self.idx_path = _paths(path_prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file (shard prefix {path_prefix})")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise ValueError(
                f"{self.idx_path}: truncated index ({idx_size} bytes, the header alone is "
                f"{_HEADER.size}); rebuild the shard"
            )
        magic, version, code, num_sequences, num_doc_indices = _HEADER.unpack(header)
        if magic != INDEX_MAGIC:
            raise ValueError(
                f"{self.idx_path}: not a Megatron indexed dataset index "
                f"(magic {magic!r}, expected {INDEX_MAGIC!r})"
            )
        if version != INDEX_VERSION:
            raise ValueError(
                f"{self.idx_path}: index version {version} is not supported "
                f"(only version {INDEX_VERSION})"
            )
        if code not in DTYPE_CODES:
            raise ValueError(
                f"{self.idx_path}: unknown dtype code {code} "
                f"(Megatron's codes are {sorted(DTYPE_CODES)})"
            )
        self.dtype: np.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 12 * num_sequences + 8 * num_doc_indices
        if idx_size != expected:
            raise ValueError(
                f"{self.idx_path}: {idx_size} bytes, but its header ({num_sequences} sequences, "
                f"{num_doc_indices} document indices) needs {expected}; the file is truncated "
                "or corrupt, rebuild the shard"
            )
        # One map of the whole index for its three arrays: every map holds a file
        # descriptor, and with one map per array a corpus of 256 shards used up a soft
        # limit of 1024 (`ulimit -n`), common on Linux. A shard now holds two.
        index = self._map(self.idx_path)
        offset = _HEADER.size
        self.sequence_lengths = self._index_array(index, np.int32, offset, num_sequences)
        offset += 4 * num_sequences
        self.sequence_pointers = self._index_array(index, np.int64, offset, num_sequences)
        offset += 8 * num_sequences
        self.document_indices = self._index_array(index, np.int64, offset, num_doc_indices)
        # Every Megatron writer starts the document index at 0 and ends it at a sequence
        # count (the last, unless sequences were added after the last document); other
        # values make document boundaries index out of range. Two reads, not a scan.
        if not num_doc_indices:
            problem = "it has no document index (Megatron's starts with 0)"
        elif self.document_indices[0] != 0:
            problem = f"its document index starts at {self.document_indices[0]}, not 0"
        elif not 0 <= self.document_indices[-1] <= num_sequences:
            problem = (
                f"its document index ends at {self.document_indices[-1]}, past its "
                f"{num_sequences} sequences"
            )
        else:
            problem = None
        if problem is not None:
            raise ValueError(f"{self.idx_path}: {problem}; the file is corrupt, rebuild the shard")

        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = self.bin_path.stat().st_size
        if num_sequences:
            end = int(self.sequence_pointers[-1]) + self.dtype.itemsize * int(
                self.sequence_lengths[-1]
            )
        else:
            end = 0
        if bin_size < end:
            raise ValueError(
                f"{self.bin_path}: {bin_size} bytes, but the index points up to byte {end}; "
                "the file is truncated, rebuild the shard"
            )
        if bin_size % self.dtype.itemsize:
            raise ValueError(
                f"{self.bin_path}: size {bin_size} is not a multiple of the {self.dtype} "
                f"item size {self.dtype.itemsize}; the file is corrupt, rebuild the shard"
            )
        if bin_size:
            self._tokens = self._map(self.bin_path, self.dtype)
        else:  # mmap cannot map an empty file
            self._tokens = np.empty(0, dtype=self.dtype)

    @staticmethod
    def _map(path: Path, dtype: np.dtype | type = np.uint8) -> np.memmap:
        try:
            return np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            higher = "unlimited" if hard == resource.RLIM_INFINITY else hard
            fix = f"`ulimit -n {higher}`" if soft != hard else "a higher hard limit"
            raise ValueError(
                f"{path}: too many open files (each open shard holds 2 file descriptors, "
                f"this process may hold {soft}); raise the limit ({fix}) or use fewer, "
                "larger shards"
            ) from None

    @staticmethod
    def _index_array(index: np.memmap, dtype: type, offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.ndarray((count,), dtype=dtype, buffer=index, offset=offset)

    @property
    def tokens(self) -> np.ndarray:
        """The whole `.bin` file as a memory-mapped 1-D array (no copy)."""
        return self._tokens

    def __len__(self) -> int:
        """Number of sequences (one per document for files moetrain writes)."""
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence `i` as a read-only view into the mapped `.bin` file.

        Args:
            i: Sequence index; negative indices count from the end.

        Returns:
            The sequence's tokens in the shard's dtype.

        Raises:
            IndexError: If `i` is out of range.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {self.idx_path} ({n} sequences)")
        i %= n
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._tokens[start : start + int(self.sequence_lengths[i])]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({os.fspath(self.idx_path)[:-4]!r}, sequences={len(self)}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )
