"""Host-side checks of rows-per-expert counts, shared by the grouped ops."""

__all__ = ["check_counts"]


def check_counts(
    counts: list[int], num_rows: int, name: str = "tokens_per_expert", rows: str = "rows of x (R)"
) -> None:
    """Raises ValueError naming the first negative count (its index and value), or the sum.

    Args:
        counts: Rows per expert (group), on the host.
        num_rows: The rows they must add up to.
        name: The argument's name in the message.
        rows: What the rows are, for the message (``"rows of x (R)"``).
    """
    for e, count in enumerate(counts):
        if count < 0:
            raise ValueError(
                f"{name}[{e}] is {count} ({name} = {counts}); counts must be >= 0: pass "
                "the rows routed to each expert"
            )
    if sum(counts) != num_rows:
        raise ValueError(
            f"{name} ({counts}) sums to {sum(counts)}, not the {num_rows} {rows}; counts "
            "must add up to the routed rows"
        )
