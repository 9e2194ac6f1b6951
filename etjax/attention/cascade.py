"""Cascade attention: decode rows that share their first pages read them once.

Rows admitted with a prefix cache hit hold the same pages for their shared beginning (the n
samples of a prompt, questions about one document, a batch job's instruction block). A plain
decode pass reads those pages once per row: on a CPU, where each read is a gather of the
pages into product order, n rows over a 2K-token prefix cost n times one row. Here the rows'
query tokens are stacked into one query tile against the shared pages, which are read once
(a matrix product instead of n matrix-vector ones), and each row reads only its own pages
after them; the kernel merges the two partial softmaxes by their log-sum-exps
(pallas_kernels/ragged_attention/xla.py).

Sharing is found from the page lists alone: two rows hold the same page only through the
prefix cache, and its pages are full and never written while shared, so rows whose page lists
start alike see those pages whole.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from pallas_kernels.ragged_attention.tiles import MIN_SHARED_ROWS, SHARED_Q_TILE
from pallas_kernels.ragged_attention.work_items import Segment, SharedPrefix


def shared_prefixes(
    segments: Sequence[Segment],
    page_size: int,
    kv_tile: int,
    q_tile: int = SHARED_Q_TILE,
    min_rows: int = MIN_SHARED_ROWS,
    max_prefixes: int | None = None,
    max_items: int | None = None,
) -> tuple[list[Segment], list[SharedPrefix]]:
    """Split one-token `segments` into shared prefixes and what each row reads alone.

    Rows are grouped by their first page, `q_tile` at a time in order; a group of at least
    `min_rows` shares the longest run of pages all its rows hold, cut to whole key tiles of
    `kv_tile` pages and to the pages before every row's position. Returns the segments with
    `skip_pages` set for the rows in a group, and the groups. At most `max_prefixes` groups
    and `max_items` key tiles in all (the pass's capacities); the rest read alone."""
    rows_by_first: dict[int, list[int]] = defaultdict(list)
    for i, seg in enumerate(segments):
        if seg.num_tokens == 1 and seg.pages:
            rows_by_first[seg.pages[0]].append(i)
    own, prefixes, items = list(segments), [], 0
    for members in rows_by_first.values():
        for start in range(0, len(members), q_tile):
            group = members[start : start + q_tile]
            if len(group) < min_rows:
                continue
            pages = [segments[i].pages for i in group]
            limit = min(
                min(len(p) for p in pages),
                min(segments[i].first_position // page_size for i in group),
            )
            common = next(
                (k for k in range(limit) if any(p[k] != pages[0][k] for p in pages)), limit
            )
            common -= common % kv_tile
            if common == 0:
                continue
            if max_prefixes is not None and len(prefixes) == max_prefixes:
                return own, prefixes
            if max_items is not None and items + common // kv_tile > max_items:
                continue
            items += common // kv_tile
            prefixes.append(
                SharedPrefix([segments[i].token_start for i in group], list(pages[0][:common]))
            )
            for i in group:
                own[i] = dataclasses.replace(segments[i], skip_pages=common)
    return own, prefixes


def blocks_read_for_others(prefixes: Sequence[SharedPrefix], num_tokens: int) -> np.ndarray:
    """Per token of a decode step [num_tokens]: the blocks of its context that a plain pass
    would have read for it alone but the shared pass read once for its whole group, less its
    own share of that read: pages x (1 - 1 / rows of the group). The bytes a step really
    reads are the plain count's less these (etjax/bench/measure.py)."""
    saved = np.zeros(num_tokens, np.float32)
    for prefix in prefixes:
        rows = len(prefix.tokens)
        for token in prefix.tokens:
            saved[token] = len(prefix.pages) * (1.0 - 1.0 / rows)
    return saved


# Rows a group of pruned rows holds at most: the C++ kernel runs a group's rows in one unit
# per KV head, so larger groups would leave a core idle (SmolLM2: 3 KV heads, 2 cores).
PRUNED_GROUP_ROWS = 8


def pruned_groups(
    segments: Sequence[Segment], page_size: int, num_rows: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The groups of a pruned decode burst's one-token `segments` (row j is token j) that
    share their first pages (etjax/pruning/groups.py): leaders [num_rows] (the first row of
    each row's group, itself for a row in none) and shared_pages [num_rows] (0 for a row in
    none), as `shared_prefixes` finds them page by page, two rows or more to a group. None
    when no rows share."""
    _, prefixes = shared_prefixes(segments, page_size, 1, PRUNED_GROUP_ROWS, min_rows=2)
    if not prefixes:
        return None
    leaders = np.arange(num_rows, dtype=np.int32)
    shared = np.zeros(num_rows, np.int32)
    for prefix in prefixes:
        leaders[prefix.tokens] = prefix.tokens[0]
        shared[prefix.tokens] = len(prefix.pages)
    return leaders, shared
