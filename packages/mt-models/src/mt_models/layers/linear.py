"""``nn.Linear`` and ``nn.Embedding`` that allocate shapes only.

The model's ``init_weights(seed)`` sets every value, so the constructors' own random
initialization is wasted work (a full kaiming draw per projection on a CPU build), and on
the meta device ``nn.Embedding``'s ``normal_`` costs ~9 s of one-time decomposition loading.
Both stay instances of the ``torch.nn`` classes, so module swaps that test
``isinstance(m, nn.Linear)`` still find them.
"""

from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` whose parameters are left uninitialized until ``init_weights``."""

    def reset_parameters(self) -> None:
        """Does nothing: values come from the model's ``init_weights``."""


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weight is left uninitialized until ``init_weights``."""

    def reset_parameters(self) -> None:
        """Does nothing: values come from the model's ``init_weights``."""
