"""The four parallel dimensions of a run and their validation.

A run is laid out on a mesh of shape (pp, dp, cp, ep): pipeline stages outermost,
then FSDP data parallelism, then context and expert parallelism innermost so that
their frequent traffic stays inside a node (ARCHITECTURE.md §5).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ep_divides_experts(ep: int, num_experts: int, ranks: int | None = None) -> None:
    """Raises ValueError, naming the sizes that fit, unless `ep` divides `num_experts`.

    Args:
        ep: expert-parallel size.
        num_experts: routed experts per MoE layer.
        ranks: the ranks dp and ep share (world_size / (pp*cp)), when known: the sizes
            named are then those that divide both.
    """
    if num_experts % ep:
        choices = _divisors(num_experts)  # all of them: 384 experts have 16
        where = ""
        if ranks is not None:
            choices = [d for d in choices if ranks % d == 0]
            where = (
                f" (the divisors of {num_experts} that also divide world_size / (pp*cp) = {ranks})"
            )
        raise ValueError(
            f"parallel.ep ({ep}) must divide num_experts ({num_experts}); "
            f"choose one of {choices}{where}"
        )


def _ep_sizes_that_fit(world_size: int, pp: int, cp: int) -> str:
    """The fix of a layout whose pp*cp*ep does not divide the world size."""
    if world_size % (pp * cp):
        return f"pp*cp ({pp}*{cp}={pp * cp}) must itself divide it: one of {_divisors(world_size)}"
    return f"with pp*cp={pp * cp}: parallel.ep one of {_divisors(world_size // (pp * cp))}"


def check_cp_divides_seq_len(cp: int, seq_len: int, ranks: int | None = None) -> None:
    """Raises ValueError, naming sequence lengths and cp sizes that fit, unless 2·cp
    divides `seq_len` (zigzag sharding cuts the sequence into 2·cp equal chunks) and
    `seq_len` >= 2·cp (every chunk holds at least one token; 0 is divisible by anything).

    Args:
        cp: context-parallel size.
        seq_len: training sequence length.
        ranks: the ranks dp and cp share (world_size / (pp*ep)), when known: the cp sizes
            named are then only those that also divide it.
    """
    if seq_len < 2 * cp:
        raise ValueError(
            f"seq_len ({seq_len}) must be >= 2*parallel.cp ({2 * cp}): zigzag context "
            f"sharding gives each of the 2*cp chunks at least one token; use seq_len a "
            f"positive multiple of {2 * cp}, or a smaller parallel.cp"
        )
    if seq_len % (2 * cp):
        lower = seq_len - seq_len % (2 * cp)
        lengths = f"{lower} or {lower + 2 * cp}" if lower else f"{2 * cp}"
        sizes = [1] + [c for c in range(2, seq_len // 2 + 1) if seq_len % (2 * c) == 0]
        where = ""
        if ranks is not None:
            sizes = [c for c in sizes if ranks % c == 0]
            where = f" (those that also divide world_size / (pp*ep) = {ranks})"
        raise ValueError(
            f"seq_len ({seq_len}) must be divisible by 2*parallel.cp ({2 * cp}) for zigzag "
            f"context sharding; use seq_len {lengths}, or parallel.cp one of "
            f"{sizes[:8]}{where}"
        )


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the pipeline, data, context and expert mesh axes.

    Args:
        world_size: number of processes in the run.
        pp: pipeline-parallel size.
        dp: data-parallel (FSDP) size; -1 means world_size // (pp * cp * ep).
        cp: context-parallel size.
        ep: expert-parallel size.
    """

    world_size: int
    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            # A float passed the checks below when the product came out right (dp=2.5 with
            # ep=1.6 on 4 ranks) and failed later in the mesh; a bool is an int to Python.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                whole = isinstance(value, float) and value.is_integer()
                fix = f"; use {name}={int(value)}" if whole else ""
                raise ValueError(
                    f"parallel.{name} ({value!r}) must be a whole number of ranks, an int, "
                    f"not {type(value).__name__}{fix}"
                )
            object.__setattr__(self, name, int(value))  # numpy integers become ints
        for name in ("world_size", "pp", "cp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"parallel.{name} ({value}) must be >= 1")
        inner = self.pp * self.cp * self.ep
        if self.dp == -1:
            if self.world_size % inner:
                raise ValueError(
                    f"world size ({self.world_size}) is not divisible by pp*cp*ep "
                    f"({self.pp}*{self.cp}*{self.ep}={inner}); choose sizes whose product "
                    f"divides {self.world_size} (one of {_divisors(self.world_size)}); "
                    + _ep_sizes_that_fit(self.world_size, self.pp, self.cp)
                )
            object.__setattr__(self, "dp", self.world_size // inner)
        if self.dp < 1:
            raise ValueError(f"parallel.dp ({self.dp}) must be >= 1, or -1 to fill the world")
        if self.pp * self.dp * self.cp * self.ep != self.world_size:
            if self.world_size % inner:  # no dp fits: deriving it would fail as well
                fix = (
                    f"pp*cp*ep ({self.pp}*{self.cp}*{self.ep}={inner}) does not divide it; "
                    f"choose pp, cp and ep whose product divides {self.world_size} "
                    f"(one of {_divisors(self.world_size)}); "
                    + _ep_sizes_that_fit(self.world_size, self.pp, self.cp)
                )
            else:
                dp = self.world_size // inner
                fix = f"set parallel.dp={dp} (or -1, which derives it)"
            raise ValueError(
                f"pp*dp*cp*ep ({self.pp}*{self.dp}*{self.cp}*{self.ep}="
                f"{self.pp * self.dp * self.cp * self.ep}) must equal the world size "
                f"({self.world_size}); {fix}"
            )

    @property
    def batch_ranks(self) -> int:
        """Number of ranks that read distinct sequences (dp * ep)."""
        return self.dp * self.ep

    def validate_model(self, *, num_experts: int, num_heads: int, seq_len: int) -> None:
        """Checks that the layout fits the model and sequence length.

        Args:
            num_experts: routed experts per MoE layer.
            num_heads: attention heads (query heads).
            seq_len: training sequence length.
        """
        check_ep_divides_experts(self.ep, num_experts, self.batch_ranks)  # dp * ep
        if self.cp > 1:
            check_cp_divides_seq_len(self.cp, seq_len, self.dp * self.cp)
        del num_heads  # context parallelism all-gathers keys and values: any head count
