"""Shape buckets: round every varying size up so that a run compiles a few programs once."""

from __future__ import annotations


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = int(max(n, minimum, 1))
    return 1 << (n - 1).bit_length()


def prompt_bucket(num_tokens: int, chunk_size: int, minimum: int = 16) -> int:
    """Padded length of a prefill chunk holding `num_tokens` (<= chunk_size) tokens."""
    return min(next_power_of_two(num_tokens, minimum), chunk_size)


def batch_bucket(num_rows: int) -> int:
    """Padded number of batch rows."""
    return next_power_of_two(num_rows)


def pages_bucket(num_pages: int) -> int:
    """Padded page-table width or page-pool size."""
    return next_power_of_two(num_pages, minimum=4)


def kept_bucket(needed: int, width: int) -> int:
    """Padded width of the kept-block table: `needed` rounded up to an eighth of the page-table
    bucket, for at most eight compiled variants per table width.

    The padding is not read: the XLA and Triton kernels loop up to the kept count, and the TPU
    kernel's grid steps past it skip their work and repeat the last block's copy.
    """
    step = max(4, pages_bucket(width) // 8)
    return min(width, -(-max(needed, 1) // step) * step)
