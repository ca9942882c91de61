"""The builder's progress bar: input MB/s and ETA, documents/s and tokens/s."""

from __future__ import annotations

import time

from tqdm import tqdm

__all__ = ["BuildProgress"]


class BuildProgress:
    """A tqdm bar over input bytes (so it shows MB/s and an ETA), with docs/s and tok/s.

    Args:
        total_bytes: Input bytes the build will read (compressed size for zstd files).
        enabled: Draw the bar (on stderr); when False, only the counts are kept.
    """

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.bar = tqdm(
            total=total_bytes or None,  # 0: unknown (in-memory documents)
            unit="B",
            unit_scale=True,
            disable=not enabled,
            smoothing=0.1,
            dynamic_ncols=True,
        )
        self.documents = 0
        self.tokens = 0
        self.start = time.perf_counter()

    def add(self, num_bytes: int, documents: int, tokens: int) -> None:
        """Count one finished batch.

        Args:
            num_bytes: Input bytes it covered.
            documents: Documents it held.
            tokens: Tokens written for them.
        """
        self.documents += documents
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.documents / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tok/s",
            refresh=False,
        )
        self.bar.update(num_bytes)

    def describe(self, name: str) -> None:
        """Show the shard being written.

        Args:
            name: Shard name.
        """
        self.bar.set_description(name, refresh=False)

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
