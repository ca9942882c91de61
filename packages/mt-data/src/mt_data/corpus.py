"""`PackedCorpus`: the shards of one corpus read as one token stream cut into samples.

Packing (as Megatron-LM's GPTDataset): the shards, in order (a directory's sorted by
name), are read as one virtual token stream, every document already ending with EOS.
Sample j is `stream[j·S : j·S + S + 1]` for sequence length S, so inputs are its first
S tokens and labels its last S, and consecutive samples share one token. There are
`(num_tokens - 1) // S` samples; the tail that does not fill one is never read.

Reading is vectorized: the samples of a batch that lie inside one shard are gathered
with one fancy index on a strided window view of that shard's memory map (windows start
every S tokens, so the view costs nothing), and only the requested column ranges are
read. Samples that straddle two shards (a handful per epoch) are copied piece by piece.

Document boundaries come from the index (Megatron's `document_indices`), not from
scanning for EOS, so they are right for Megatron corpora built without EOS too.

Shape suffixes: B rows of the batch being read, W columns returned (Σ of the ranges),
G rows gathered in one pass (one column range), R rows of one shard, S document starts.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mt_data.indexed import IndexedDataset
from mt_data.manifest import MANIFEST_NAME, RECORD_DIR, read_manifest

__all__ = ["PackedCorpus", "resolve_shards"]

# Sequences per step of the contiguity check when a shard is opened.
_CHECK_CHUNK = 1 << 20


def _directory_shards(path: Path, manifest: dict[str, Any] | None) -> list[Path]:
    """A directory's shard prefixes, sorted by name: those its manifest.json (`manifest`,
    None where it has none) lists (an mt-data corpus; other `*.idx` there are named in a
    warning), else every `*.idx` (a Megatron directory, or a hand-written manifest that
    lists no shards)."""
    if manifest is None and (path / RECORD_DIR).is_dir():
        raise ValueError(
            f"data path {path}: an mt-data build into it has not finished (no "
            f"{MANIFEST_NAME}); rerun the same `mt-data build` command to complete it"
        )
    if manifest is None or "shards" not in manifest:
        return sorted(p.with_suffix("") for p in path.glob("*.idx") if p.is_file())
    try:
        names = [str(shard["name"]) for shard in manifest["shards"]]
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path / MANIFEST_NAME}: 'shards' is not a list of objects with a 'name' "
            f"({e!r}); rebuild the corpus"
        ) from None
    missing = [n for n in names if not (path / f"{n}.idx").is_file()]
    if missing:
        raise ValueError(
            f"{path / MANIFEST_NAME} lists shards {missing} that are not in {path} (no .idx); "
            "rebuild the corpus"
        )
    unlisted = sorted({p.stem for p in path.glob("*.idx") if p.is_file()} - set(names))
    if unlisted:  # a failed build's new shards, another tool's files, older mt-data's leftovers
        warnings.warn(
            f"{path}: shards {unlisted[:5]} are not in its {MANIFEST_NAME} and are not read; "
            "rebuild with their inputs to include them, or delete them",
            stacklevel=4,
        )
    return sorted(path / n for n in names)


def resolve_shards(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Shard prefixes of corpus paths: a directory gives its shards sorted by name (those
    its manifest.json lists, or every `*.idx` of a directory without one); any other path
    is a shard prefix (`data/foo` for `data/foo.bin` + `.idx`, as Megatron-LM's
    `--data-path` takes it; a trailing `.idx` or `.bin` is dropped).

    Args:
        paths: Directories and shard prefixes.

    Returns:
        The shard prefixes, in order.

    Raises:
        ValueError: If a path is neither a directory with shards nor a shard prefix, a
            shard's `.bin` is missing, or a directory's mt-data build is unfinished or
            lists missing shards.
    """
    return _resolve_shards(paths)[0]


def _resolve_shards(
    paths: Sequence[str | os.PathLike[str]],
) -> tuple[list[Path], dict[Path, dict[str, Any] | None]]:
    """`resolve_shards`, and the manifest.json it read of each directory (None: it has none),
    so that `_check_manifest_counts` need not read them again."""
    prefixes: list[Path] = []
    manifests: dict[Path, dict[str, Any] | None] = {}
    for item in paths:
        path = Path(item).expanduser()
        if path.is_dir():
            manifests[path] = read_manifest(path)
            found = _directory_shards(path, manifests[path])
            # `.tmp`, or `.<pid>-<random>.tmp` from a build without flock
            partial = [] if found else sorted(p.name for p in path.glob("*.idx*.tmp"))
            if not found and partial:  # a first build killed before any shard was done
                raise ValueError(
                    f"data path {path} holds no shards (*.idx + *.bin), only the partial "
                    f"files of a build that has not finished ({', '.join(partial[:3])}); "
                    "unless it is still running, rerun that `mt-data build` command"
                )
            if not found:
                raise ValueError(
                    f"data path {path} holds no shards (*.idx + *.bin); build one with "
                    "`mt-data build ... --output DIR` or use mt_data.default_corpus_dir()"
                )
            prefixes.extend(found)
            continue
        if path.suffix in (".idx", ".bin"):
            path = path.with_suffix("")
        if not Path(f"{path}.idx").is_file():
            raise ValueError(
                f"data path {item}: neither a directory of shards nor a shard prefix "
                f"({path}.idx does not exist)"
            )
        prefixes.append(path)
    # IndexedDataset would raise FileNotFoundError, which callers that report ValueErrors
    # (TokenDataset's, the trainer's) let through as a traceback.
    for prefix in prefixes:
        if not Path(f"{prefix}.bin").is_file():
            raise ValueError(
                f"shard {prefix}.idx has no {prefix.name}.bin beside it (an incomplete copy?); "
                "copy the .bin too or rebuild the corpus"
            )
    return prefixes, manifests


def _check_manifest_counts(
    shards: Sequence[IndexedDataset], read: dict[Path, dict[str, Any] | None]
) -> None:
    """Raise if a shard's documents, tokens or dtype differ from what its directory's
    manifest.json lists for it (a shard of another build copied in, say): the manifest's
    vocabulary and EOS would then describe tokens it did not write. `read` holds the
    manifests `_resolve_shards` read (a directory's); the others (a shard prefix's
    directory) are read here."""
    manifests: dict[Path, dict[str, Any]] = {}
    for shard in shards:
        directory = shard.idx_path.parent
        if directory not in manifests:
            manifest = (read[directory] if directory in read else read_manifest(directory)) or {}
            listed = manifest.get("shards")
            entries = listed if isinstance(listed, list) else []
            manifests[directory] = {
                "dtype": manifest.get("dtype"),
                "shards": {str(e.get("name")): e for e in entries if isinstance(e, dict)},
            }
        manifest = manifests[directory]
        entry = manifest["shards"].get(shard.idx_path.stem)
        if entry is None:
            continue  # a Megatron shard, or one a warning already named as not listed
        found = {
            "documents": len(shard),
            "tokens": shard.num_tokens,
            "dtype": str(shard.dtype),
        }
        listed = {
            "documents": entry.get("documents"),
            "tokens": entry.get("tokens"),
            "dtype": manifest["dtype"],
        }
        if any(listed[k] is not None and listed[k] != found[k] for k in found):
            raise ValueError(
                f"{shard.idx_path} holds {found['documents']} documents and "
                f"{found['tokens']} {found['dtype']} tokens, but {directory / MANIFEST_NAME} "
                f"lists {listed['documents']} documents and {listed['tokens']} "
                f"{listed['dtype']} tokens for it: the shard is not the one this build "
                "wrote (copied from another build?); rebuild the corpus (rerun its "
                "`mt-data build` command) or copy the whole directory, manifest included"
            )


class PackedCorpus:
    """Shards read as one stream of samples of `seq_len + 1` tokens.

    Args:
        paths: Directories of shards and/or shard prefixes.
        seq_len: Tokens per training sequence; a sample holds `seq_len + 1`.

    Raises:
        ValueError: If there are no shards, a shard is unreadable, not contiguous or not
            what its directory's manifest.json lists, or the corpus has fewer than
            `seq_len + 1` tokens.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], seq_len: int) -> None:
        self.seq_len = seq_len
        prefixes, manifests = _resolve_shards(paths)
        self.shards = [IndexedDataset(p) for p in prefixes]
        _check_manifest_counts(self.shards, manifests)
        self._streams = [self._token_stream(shard) for shard in self.shards]
        lengths = np.array([len(s) for s in self._streams], dtype=np.int64)
        # shard_starts[i]: position of shard i's first token in the stream; [-1] = total.
        self.shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        self.num_samples = (self.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            names = ", ".join(str(p) for p in paths)
            raise ValueError(
                f"data path {names} holds {self.num_tokens} tokens, too few for one "
                f"sample of seq_len + 1 = {seq_len + 1}; lower seq_len or add data"
            )

    @staticmethod
    def _token_stream(shard: IndexedDataset) -> np.ndarray:
        """The shard's documents as one memory-mapped array, checking they are contiguous."""
        if len(shard) == 0:
            return shard.tokens[:0]
        # Checked in chunks, so opening a shard of 10^9 documents needs no 8 GB array.
        item = shard.dtype.itemsize
        offset = 0  # tokens before the chunk
        contiguous = True
        for first in range(0, len(shard), _CHECK_CHUNK):
            lengths = shard.sequence_lengths[first : first + _CHECK_CHUNK].astype(np.int64)
            # The pointer check below passes a negative length the pointers were derived from.
            if len(lengths) and lengths.min() < 0:
                bad = first + int(np.argmax(lengths < 0))
                raise ValueError(
                    f"{shard.idx_path}: sequence {bad} has length {lengths[bad - first]} (a "
                    "corrupt index, or a length past 2**31 wrapped around by its writer); "
                    "rebuild the shard, splitting such documents"
                )
            starts = np.cumsum(lengths) - lengths + offset
            if not np.array_equal(shard.sequence_pointers[first : first + len(lengths)],
                                  starts * item):  # fmt: skip
                contiguous = False
                break
            offset += int(lengths.sum())
        if not contiguous:
            raise ValueError(
                f"{shard.idx_path}: sequences are not stored back to back in the .bin file; "
                "TokenDataset reads contiguous shards only (rebuild it with mt-data build)"
            )
        return shard.tokens[: shard.num_tokens]

    def read(
        self, samples_B: np.ndarray, ranges: Sequence[tuple[int, int]], out_BW: np.ndarray
    ) -> None:
        """Copy columns `ranges` of samples `samples_B` into `out_BW`, range after range.

        Args:
            samples_B: Unshuffled sample indices in `[0, num_samples)`.
            ranges: (start, end) column ranges within a sample of `seq_len + 1` tokens.
            out_BW: Output rows, `W = Σ (end - start)` columns.
        """
        column = 0
        for start, end in ranges:
            width = end - start
            first_G = samples_B * self.seq_len + start  # stream position of each row's slice
            self._gather(first_G, width, out_BW[:, column : column + width])
            column += width

    def _gather(self, first_G: np.ndarray, width: int, out: np.ndarray) -> None:
        shard_G = np.searchsorted(self.shard_starts, first_G, side="right") - 1
        inside_G = first_G + width <= self.shard_starts[shard_G + 1]
        for shard in np.unique(shard_G[inside_G]):
            rows = np.flatnonzero(inside_G & (shard_G == shard))
            stream = self._streams[shard]
            local = first_G[rows] - self.shard_starts[shard]
            # Every row starts at the same offset modulo seq_len: view the shard as
            # windows of `width` tokens every seq_len tokens and gather whole windows.
            base = int(local[0] % self.seq_len)
            num_windows = (len(stream) - base - width) // self.seq_len + 1
            windows = np.lib.stride_tricks.as_strided(
                stream[base:],
                shape=(num_windows, width),
                strides=(self.seq_len * stream.itemsize, stream.itemsize),
                writeable=False,
            )
            picked = windows[(local - base) // self.seq_len]
            if len(rows) == len(out):
                out[...] = picked  # one shard holds the whole batch: no scatter
            else:
                out[rows] = picked
        for row in np.flatnonzero(~inside_G):  # straddles shards: copy piece by piece
            self._copy(int(first_G[row]), out[row])

    def _copy(self, first: int, out: np.ndarray) -> None:
        shard = int(np.searchsorted(self.shard_starts, first, side="right")) - 1
        filled = 0
        while filled < len(out):
            offset = first + filled - int(self.shard_starts[shard])
            piece = self._streams[shard][offset : offset + len(out) - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1

    def document_starts(self, first: int, last: int) -> np.ndarray:
        """Stream positions in `(first, last)` where a document begins.

        Args:
            first: Stream position (exclusive).
            last: Stream position (exclusive).

        Returns:
            Sorted int64 positions.
        """
        found: list[np.ndarray] = []
        k = int(np.searchsorted(self.shard_starts, first, side="right")) - 1
        while k < len(self.shards) and self.shard_starts[k] < last:
            shard = self.shards[k]
            base = int(self.shard_starts[k])
            if len(shard):
                item = shard.dtype.itemsize
                pointers = shard.sequence_pointers
                bounds = [(first - base + 1) * item, (last - base) * item]
                lo, hi = np.searchsorted(pointers, bounds)
                seqs = np.arange(lo, hi, dtype=np.int64)
                docs = shard.document_indices
                is_doc = docs[np.minimum(np.searchsorted(docs, seqs), len(docs) - 1)] == seqs
                found.append(base + np.asarray(pointers[seqs[is_doc]]) // item)
                if first < base:  # the shard's first token starts a document
                    found.append(np.array([base], dtype=np.int64))
            k += 1
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(found)).astype(np.int64)

    def positions(
        self, samples_B: np.ndarray, ranges: Sequence[tuple[int, int]], out_BW: np.ndarray
    ) -> None:
        """Position ids of the columns `read` returns: tokens since the document start.

        Positions count from 0 at each sample's first token and restart at 0 at every
        document start inside the sample.

        Args:
            samples_B: Unshuffled sample indices.
            ranges: Column ranges, as for `read`.
            out_BW: Output rows.
        """
        width = self.seq_len + 1
        first_B = samples_B.astype(np.int64) * self.seq_len
        # last_start_BW[b, i] = column of the latest document start at or before column i.
        last_start_BW = np.zeros((len(samples_B), width), dtype=np.int64)
        shard_B = np.searchsorted(self.shard_starts, first_B, side="right") - 1
        inside_B = first_B + width <= self.shard_starts[shard_B + 1]
        for shard in np.unique(shard_B[inside_B]):
            rows = np.flatnonzero(inside_B & (shard_B == shard))
            rows_S, columns_S = self._starts_in_shard(int(shard), first_B[rows], width)
            last_start_BW[rows[rows_S], columns_S] = columns_S
        for row in np.flatnonzero(~inside_B):  # straddles shards
            columns = self.document_starts(int(first_B[row]), int(first_B[row]) + width)
            columns -= first_B[row]
            last_start_BW[row, columns] = columns
        np.maximum.accumulate(last_start_BW, axis=1, out=last_start_BW)
        positions_BW = np.arange(width, dtype=np.int64) - last_start_BW
        column = 0
        for start, end in ranges:
            out_BW[:, column : column + end - start] = positions_BW[:, start:end]
            column += end - start

    def _starts_in_shard(
        self, shard: int, first_R: np.ndarray, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(row, column) of every document start strictly inside each row's window."""
        dataset = self.shards[shard]
        item = dataset.dtype.itemsize
        local_R = first_R - self.shard_starts[shard]
        pointers = dataset.sequence_pointers
        lo_R = np.searchsorted(pointers, (local_R + 1) * item)
        hi_R = np.searchsorted(pointers, (local_R + width) * item)
        count_R = hi_R - lo_R
        rows_S = np.repeat(np.arange(len(first_R)), count_R)
        # Sequence indices lo..hi-1 of every row, flattened.
        seqs_S = np.arange(int(count_R.sum())) - np.repeat(np.cumsum(count_R) - count_R, count_R)
        seqs_S += np.repeat(lo_R, count_R)
        docs = dataset.document_indices
        if len(docs) != len(pointers) + 1:  # several sequences per document (Megatron)
            hit = docs[np.minimum(np.searchsorted(docs, seqs_S), len(docs) - 1)] == seqs_S
            rows_S, seqs_S = rows_S[hit], seqs_S[hit]
        columns_S = np.asarray(pointers[seqs_S]) // item - local_R[rows_S]
        return rows_S, columns_S
