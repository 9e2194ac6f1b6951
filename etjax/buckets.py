"""Shape buckets: round every varying size up so that a run compiles a few programs once."""

from __future__ import annotations


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = int(max(n, minimum, 1))
    return 1 << (n - 1).bit_length()


def prompt_bucket(num_tokens: int, chunk_size: int, minimum: int = 16) -> int:
    """Padded length of a prefill chunk holding `num_tokens` (<= chunk_size) tokens."""
    return min(next_power_of_two(num_tokens, minimum), chunk_size)


def ragged_token_bucket(num_tokens: int) -> int:
    """Padded token count of a ragged step: a power of two from 8 up (a lone row's token and
    its drafts fit 8)."""
    return next_power_of_two(num_tokens, minimum=8)


def batch_bucket(num_rows: int) -> int:
    """Padded number of batch rows."""
    return next_power_of_two(num_rows)


def pages_bucket(num_pages: int) -> int:
    """Padded page-table width or page-pool size."""
    return next_power_of_two(num_pages, minimum=4)
