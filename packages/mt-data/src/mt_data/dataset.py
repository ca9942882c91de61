"""`TokenDataset`: fixed-length training samples from a corpus directory, shuffled per epoch.

Packing (as Megatron-LM's GPTDataset): the shards of a corpus directory, sorted by name,
are read as one virtual token stream, every document already ending with EOS. Sample j
is `stream[j·S : j·S + S + 1]` for sequence length S, so inputs are its first S tokens and
labels its last S, and consecutive samples share one token. There are
`(num_tokens - 1) // S` samples; the tail that does not fill one is never read.

Order: epoch k visits all samples in the order of
`np.random.default_rng([seed, k]).permutation(num_samples)`. The state is the number of
samples consumed by all ranks together; position c is sample
`permutation(c // num_samples)[c % num_samples]`, so saving `consumed_samples` in a
checkpoint and loading it gives exactly the batches an uninterrupted run would have.

Nothing but the shard indexes and the current epoch's permutation (8 bytes per sample)
is held in memory: samples are copied out of memory-mapped `.bin` files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from mt_data.indexed import IndexedDataset
from mt_data.manifest import read_manifest

__all__ = ["DataExhausted", "TokenDataset"]

OnExhausted = Literal["repeat", "stop"]


class DataExhausted(Exception):
    """Raised by `TokenDataset.take` under `on_exhausted="stop"` when the epoch ends.

    Nothing is consumed by the call that raises.
    """


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return int(value)


class TokenDataset:
    """Packed, globally shuffled samples of `seq_len + 1` tokens from a corpus directory.

    Args:
        data_dir: Directory of `.bin`/`.idx` shards (as `build_corpus` writes).
        seq_len: Tokens per training sequence; each sample holds `seq_len + 1`.
        seed: Seed of the per-epoch shuffles.
        on_exhausted: When an epoch runs out: "repeat" continues into the next epoch's
            permutation; "stop" makes `take` raise `DataExhausted`.

    Raises:
        ValueError: If the directory holds no shards, a shard is unreadable, or the
            corpus has fewer than `seq_len + 1` tokens.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        *,
        seed: int = 0,
        on_exhausted: OnExhausted = "repeat",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.seq_len = _check_positive_int("seq_len", seq_len)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed ({seed!r}) must be a non-negative integer")
        self.seed = int(seed)
        if on_exhausted not in ("repeat", "stop"):
            raise ValueError(f"on_exhausted ({on_exhausted!r}) must be 'repeat' or 'stop'")
        self.on_exhausted: OnExhausted = on_exhausted
        if not self.data_dir.is_dir():
            raise ValueError(f"data_dir {self.data_dir}: no such directory")
        prefixes = sorted(p.with_suffix("") for p in self.data_dir.glob("*.idx") if p.is_file())
        if not prefixes:
            raise ValueError(
                f"data_dir {self.data_dir} holds no shards (*.idx + *.bin); build one with "
                "`mt-data build ... --output DIR` or use mt_data.default_corpus_dir()"
            )
        self.shards = [IndexedDataset(p) for p in prefixes]
        self._streams = [self._token_stream(shard) for shard in self.shards]
        lengths = np.array([len(s) for s in self._streams], dtype=np.int64)
        # shard_starts[i]: position of shard i's first token in the virtual stream.
        self._shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self._shard_starts[-1])
        self.num_samples = (self.num_tokens - 1) // self.seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"data_dir {self.data_dir} holds {self.num_tokens} tokens, too few for one "
                f"sample of seq_len + 1 = {self.seq_len + 1}; lower seq_len or add data"
            )
        manifest = read_manifest(self.data_dir) or {}
        self.vocab_size: int | None = manifest.get("vocab_size")
        self.eos_id: int | None = manifest.get("eos_id")
        self.consumed_samples = 0
        self._permutation_epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)

    @staticmethod
    def _token_stream(shard: IndexedDataset) -> np.ndarray:
        """The shard's documents as one memory-mapped array, checking they are contiguous."""
        if len(shard) == 0:
            return shard.tokens[:0]
        lengths = shard.sequence_lengths.astype(np.int64)
        expected = np.concatenate([[0], np.cumsum(lengths[:-1])]) * shard.dtype.itemsize
        if not np.array_equal(shard.sequence_pointers, expected):
            raise ValueError(
                f"{shard.idx_path}: sequences are not stored back to back in the .bin file; "
                "TokenDataset reads contiguous shards only (rebuild it with mt-data build)"
            )
        return shard.tokens[: shard.num_tokens]

    def __len__(self) -> int:
        """Number of samples in one epoch."""
        return self.num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from (0 until the first epoch is used up)."""
        return self.consumed_samples // self.num_samples

    def sample(self, j: int) -> np.ndarray:
        """Unshuffled sample `j`: `seq_len + 1` tokens of the stream starting at `j·seq_len`.

        Args:
            j: Sample index in `[0, num_samples)`.

        Returns:
            int64 array of shape `[seq_len + 1]`; it may span documents and shards.

        Raises:
            IndexError: If `j` is out of range.
        """
        if not 0 <= j < self.num_samples:
            raise IndexError(f"sample {j} out of range [0, {self.num_samples})")
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        start = j * self.seq_len
        end = start + self.seq_len + 1
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        filled = 0
        while filled < len(out):
            offset = start + filled - int(self._shard_starts[shard])
            piece = self._streams[shard][offset : offset + (end - start - filled)]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        return out

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`: `default_rng([seed, epoch]).permutation(num_samples)`.

        Args:
            epoch: Epoch number, from 0.

        Returns:
            int64 array holding each sample index once.
        """
        if epoch != self._permutation_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._permutation = rng.permutation(self.num_samples).astype(np.int64, copy=False)
            self._permutation_epoch = epoch
        return self._permutation

    def take(self, global_batch_size: int, *, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The rank's rows of the next global batch; advances `consumed_samples` by all of it.

        Every rank calls `take` with the same `global_batch_size` and gets rows
        `[rank·b, (rank+1)·b)` of the same global batch, `b = global_batch_size // world_size`.

        Args:
            global_batch_size: Samples in the batch over all data-parallel ranks.
            rank: This rank's index among the ranks that split the batch.
            world_size: Number of ranks splitting the batch; must divide it.

        Returns:
            int64 array `[global_batch_size // world_size, seq_len + 1]`.

        Raises:
            ValueError: On a bad batch size, rank or world size.
            DataExhausted: Under `on_exhausted="stop"`, if the epoch has fewer samples left
                than the batch; nothing is consumed then.
        """
        global_batch_size = _check_positive_int("global_batch_size", global_batch_size)
        world_size = _check_positive_int("world_size", world_size)
        if global_batch_size % world_size:
            raise ValueError(
                f"world_size ({world_size}) must divide global_batch_size "
                f"({global_batch_size}); choose a batch size that is a multiple of it"
            )
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
            raise ValueError(f"rank ({rank!r}) must be an integer")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        if (
            self.on_exhausted == "stop"
            and self.consumed_samples + global_batch_size > self.num_samples
        ):
            left = max(self.num_samples - self.consumed_samples, 0)
            raise DataExhausted(
                f"{self.data_dir}: {left} of {self.num_samples} samples left in the epoch, "
                f"fewer than global_batch_size {global_batch_size} (on_exhausted='stop')"
            )
        rows = global_batch_size // world_size
        first = self.consumed_samples + rank * rows
        batch = np.empty((rows, self.seq_len + 1), dtype=np.int64)
        for i in range(rows):
            epoch, position = divmod(first + i, self.num_samples)
            batch[i] = self.sample(int(self.permutation(epoch)[position]))
        self.consumed_samples += global_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position to save in a checkpoint.

        Returns:
            `consumed_samples`, `seed`, `seq_len` and `num_samples` (the latter two to
            check that a resume reads the same samples).
        """
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict()`; the seed is taken from the state.

        Args:
            state: A dict from `state_dict()`.

        Raises:
            ValueError: If a key is missing, or `seq_len` or `num_samples` differ from
                this dataset's (the samples would not be the same ones).
        """
        missing = {"consumed_samples", "seed", "seq_len", "num_samples"} - set(state)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}; got keys {sorted(state)}")
        if int(state["seq_len"]) != self.seq_len:
            raise ValueError(
                f"data loader state has seq_len {state['seq_len']}, this dataset "
                f"{self.seq_len}; resume with seq_len={state['seq_len']} or start a new run"
            )
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"data loader state has num_samples {state['num_samples']}, but "
                f"{self.data_dir} gives {self.num_samples} with seq_len {self.seq_len}: the "
                "corpus changed; resume with the original corpus or start a new run"
            )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples ({consumed}) in the state must be >= 0")
        self.consumed_samples = consumed
        self.seed = int(state["seed"])
        self._permutation_epoch = -1  # the seed may have changed

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.data_dir)!r}, seq_len={self.seq_len}, shards="
            f"{len(self.shards)}, tokens={self.num_tokens}, samples={self.num_samples}, "
            f"consumed={self.consumed_samples})"
        )
