"""Host-side page allocation: which pages of the pool belong to which sequence."""

from __future__ import annotations

import numpy as np

from etjax.cache.kv_cache import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a request needs."""


class PageAllocator:
    """A free list over pages 1..num_pages-1 (page 0 is the null page, never handed out)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[int]:
        """The free list, for checks (a copy)."""
        return list(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free pages; raises OutOfPagesError and takes none if too few are free."""
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool."""
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def page_table_rows(pages_per_row: list[list[int]], width: int) -> np.ndarray:
    """Pack per-sequence page lists into a [rows, width] int32 table padded with the null page."""
    table = np.full((len(pages_per_row), width), NULL_PAGE, dtype=np.int32)
    for row, pages in enumerate(pages_per_row):
        table[row, : len(pages)] = pages
    return table
