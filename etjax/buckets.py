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


def cut_to_bucket(others: int, chunk: int, fixed_tokens: float | None) -> int:
    """How many tokens of a prompt chunk a ragged step takes, when the step's other tokens
    (decoding rows, drafts, earlier chunks) number `others`: all `chunk`, or fewer when that
    brings the step down to the next smaller bucket and the rest, run in a step of its own,
    costs less than the padding it saves.

    A step costs about its padded tokens plus `fixed_tokens` (what a step costs besides
    them, in tokens; None: never cut). On a 2-core CPU a prefill costs its tokens: 136 tokens
    padded to 256 took 0.69 s of CPU time where 128 took 0.40 and 8 took 0.07 (SmolLM2,
    2026-12-07), so 136 runs as 128 then 8. On an accelerator a step's cost is reading the
    weights whatever its tokens, and no cut pays."""
    total = others + chunk
    padded = ragged_token_bucket(total)
    smaller = padded // 2
    if fixed_tokens is None or others >= smaller or total <= smaller:
        return chunk
    rest = total - smaller
    if ragged_token_bucket(rest) + fixed_tokens < padded - smaller:
        return smaller - others
    return chunk
