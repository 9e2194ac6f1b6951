"""Split one round's batch into device bursts of similar attention width.

Every row of a decode burst attends over the burst's padded width: the page table is as wide
as its longest row needs, and under pruning the kept-block table is as wide as its largest
budget. One 6K-token document in a batch of short prompts makes every short row read (or, in
the sparse path, score and pad to) 6K tokens of KV. Running the long rows in a burst of their
own reads the weights once more but can save far more KV traffic; this module decides when.

Rows are sorted by the width they need and cut into at most `max_groups` contiguous groups
that minimise the sum of the bursts' estimated bytes (the backend's `burst_cost`,
which mirrors the shapes `decode` will use). With n <= 32 rows the exact dynamic programme
over cut points costs a few thousand cost evaluations on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def split_by_width(
    rows: Sequence[T],
    width_of: Callable[[T], float],
    burst_bytes: Callable[[Sequence[T]], float],
    max_groups: int,
) -> list[list[T]]:
    """The cheapest partition of `rows` into at most `max_groups` bursts of contiguous widths.

    Returns the groups (each non-empty, widths ascending); a single group when splitting does
    not pay. Ties prefer fewer groups.
    """
    ordered = sorted(rows, key=width_of)
    n = len(ordered)
    if n <= 1 or max_groups <= 1:
        return [list(ordered)] if ordered else []
    cost = {(i, j): burst_bytes(ordered[i:j]) for i in range(n) for j in range(i + 1, n + 1)}
    # best[g][j]: cheapest split of ordered[:j] into g groups, with the cut that achieves it.
    inf = float("inf")
    best = [[(inf, -1)] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = (0.0, -1)
    for g in range(1, max_groups + 1):
        for j in range(1, n + 1):
            best[g][j] = min(
                ((best[g - 1][i][0] + cost[i, j], i) for i in range(j) if best[g - 1][i][0] < inf),
                default=(inf, -1),
            )
    groups_used = min(range(1, max_groups + 1), key=lambda g: (best[g][n][0], g))
    cuts, j = [], n
    for g in range(groups_used, 0, -1):
        i = best[g][j][1]
        cuts.append((i, j))
        j = i
    return [list(ordered[i:j]) for i, j in reversed(cuts)]
