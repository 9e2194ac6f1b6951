"""Prompt lookup: draft the tokens that followed the sequence's current tail before."""

from __future__ import annotations

import numpy as np


def lookup_draft(context: np.ndarray, length: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `length` tokens proposed to follow `context` [n] int32 (prompt and output so far).

    The earlier occurrences of the context's last g tokens are found for g from 1 up, each
    tail's among the last one's, until none is left or g reaches ngram_max: the longest tail
    found (at least ngram_min tokens) decides. Of its occurrences, the latest followed by
    `length` tokens (else the latest) proposes the tokens that followed it (fewer where the
    context ends first). No match: no draft.

    Longest, not latest: copying a list or a passage, a short tail ("\n- ") recurs after
    every item, and its latest occurrence is the item just copied, whose successor is
    rejected at once; the longest tail is found where the text being copied continues.
    Each step compares only the occurrences left, so a lookup costs one pass over the
    context and microseconds per sequence even at thousands of tokens.
    """
    if length <= 0:
        return []
    size, found = _longest_tail(context, ngram_max)
    if size < ngram_min:
        return []
    n = len(context)
    whole = found[found + length <= n]
    follow = whole[-1] if len(whole) else found[-1]
    return context[follow : follow + length].tolist()


def matched_tail(context: np.ndarray, ngram_max: int) -> int:
    """How many of `context`'s last tokens ([n] int32) recur earlier in it, up to ngram_max:
    the tail `lookup_draft` matches (0 where the last token is new). A long one is a copy
    under way: the text being copied continues where the tail recurs (etjax/drafting/rule.py,
    `COPY_TAIL`)."""
    return _longest_tail(context, ngram_max)[0]


def _longest_tail(context: np.ndarray, ngram_max: int) -> tuple[int, np.ndarray]:
    # The longest tail g <= ngram_max of the context found earlier in it, and the ends
    # (exclusive, <= n - 1) of its earlier occurrences; (0, empty) where none is.
    n = len(context)
    if n < 2:
        return 0, np.zeros(0, np.int64)
    ends = np.flatnonzero(context[: n - 1] == context[n - 1]) + 1
    found, g = (0, ends), 1
    while len(ends):
        found = (g, ends)
        if g == min(ngram_max, n - 1):
            break
        ends = ends[ends > g]  # room for one more token before the occurrence
        ends = ends[context[ends - g - 1] == context[n - g - 1]]
        g += 1
    return found


class TokenHistory:
    """A sequence's prompt and output as one growing int32 array, appended to rather than
    rebuilt each round (lookups read it every step)."""

    def __init__(self) -> None:
        self._buffer = np.zeros(256, np.int32)
        self._size = 0

    def view(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        """The tokens of `prompt` + `generated` (both only ever grow), as an array."""
        total = len(prompt) + len(generated)
        if total > len(self._buffer):
            grown = np.zeros(max(total, 2 * len(self._buffer)), np.int32)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        if self._size < len(prompt):
            self._buffer[self._size : len(prompt)] = prompt[self._size :]
            self._size = len(prompt)
        start = self._size - len(prompt)
        self._buffer[self._size : total] = generated[start:]
        self._size = total
        return self._buffer[:total]
