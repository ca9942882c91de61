"""A seeded permutation of [0, n) computed index by index: no array of n entries.

`IndexPermutation(n, key)(positions)` gives the sample at each position of a shuffled
epoch. It is a keyed Feistel network on the smallest even number of bits that covers n,
with cycle walking (re-encrypting values that land in [n, 2^bits) until they fall below
n), the standard construction of a format-preserving permutation (Black & Rogaway,
"Ciphers with arbitrary finite domains", 2002). A Feistel network is a bijection for any
round function, so the result is a permutation whatever the key; the round function is
the splitmix64 finalizer, which mixes well enough that consecutive positions land far
apart. Memory is O(1) in n, so a corpus of 10^9 samples is shuffled without an 8 GB
index, and any position can be looked up directly, which makes resuming free.

Since 2^bits < 4n, a value needs fewer than 4 encryptions on average.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IndexPermutation"]

# Rounds of the Feistel network: 4 make a pseudo-random permutation (Luby-Rackoff); 6 add
# margin for a round function that is a fast mixer rather than a cryptographic one.
_ROUNDS = 6
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (multiplication wraps modulo 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX_1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX_2
    return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """A pseudo-random permutation of `[0, n)` chosen by `key`, evaluated elementwise.

    Args:
        n: Size of the domain.
        key: Integers seeding the permutation (say `[seed, corpus, epoch]`).

    Raises:
        ValueError: If `n` is not a positive integer.
    """

    def __init__(self, n: int, key: list[int]) -> None:
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
            raise ValueError(f"n ({n!r}) must be a positive integer")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        rng = np.random.default_rng(key)
        self._keys = rng.integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> self._half
        right = x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted value of each position.

        Args:
            positions: Integers in `[0, n)`, any shape.

        Returns:
            int64 array of the same shape; distinct positions give distinct values.
        """
        shape = np.shape(positions)
        # At least 1-D: numpy computes on a 0-d array as on a scalar, which warns when the
        # mixing multiplications wrap and cannot be assigned to by mask when cycle walking.
        x = np.array(positions, dtype=np.uint64, ndmin=1)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} out of range [0, {self.n})")
        out = self._encrypt(x)
        outside = out >= self.n
        while outside.any():  # cycle walking: at most a few rounds
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64).reshape(shape)
