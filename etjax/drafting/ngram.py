"""Prompt lookup: draft the tokens that followed the sequence's current tail before."""

from __future__ import annotations

import numpy as np


def lookup_draft(context: np.ndarray, length: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `length` tokens proposed to follow `context` [n] int32 (prompt and output so far).

    The last g tokens (g from ngram_max down to ngram_min) are searched for in the earlier
    context; at the latest match followed by `length` tokens (else the latest match), the
    tokens that followed it are proposed (fewer where the context ends first). No match: no
    draft. One vectorised comparison per tail length, so a
    round costs microseconds per sequence even at thousands of tokens.
    """
    n = len(context)
    if length <= 0:
        return []
    for g in range(min(ngram_max, n - 1), ngram_min - 1, -1):
        tail = context[n - g :]
        # Windows starting at 0 .. n - g - 1: every occurrence before the tail itself.
        starts = np.ones(n - g, bool)
        for offset in range(g):
            starts &= context[offset : n - g + offset] == tail[offset]
        hits = np.flatnonzero(starts)
        if len(hits):
            whole = hits[hits + g + length <= n]
            follow = (whole[-1] if len(whole) else hits[-1]) + g
            return context[follow : follow + length].tolist()
    return []


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
