"""What a server runs before `/health` says ready: requests that compile the step programs
plain requests will run, so no client's request waits for a compiler.

An engine runs one program per shape bucket (etjax/buckets.py), the rest of a step's shape
being fixed for its life (etjax/engine/step_inputs.py `StepGeometry`): a ragged step, prompt
chunks beside decoding rows, per padded token count (8 up to the token budget), and a decode
burst per padded row count (1 up to `max_batch_size`). A server whose warm-up ran one request
compiled one of each; 16 clients arriving together then compiled three more programs inside
their requests (a ragged step of 16, 64 and 128 tokens and a burst of 16 rows; issue 64's
overhead run lost a quarter of one repetition to them, docs/PERF.md).

`buckets` (the default) runs, for each token bucket, one prompt of that many tokens alone
(its prefill is a ragged step of exactly that size; a bucket larger than `prefill_chunk`,
which only several prompts' chunks together fill, is left to the first such round), then,
for each row bucket, that many short prompts at once for a burst or two of that many rows.
No prompt shares a page another filled, so the prefix cache shortens none of them. What
neither wave runs still compiles when it first comes: a JSON schema's constrained rows,
speculation's verifying steps, a pruned step at a new width. `one` runs a single short
request (the prefill and a burst of one row): a quicker start where a first batch may wait,
as in the tests.
"""

from __future__ import annotations

from etjax.buckets import batch_bucket, ragged_token_bucket
from etjax.request_fields import RequestSettings

WARM_UPS = ("buckets", "one")
WARMUP_TEXT = "Hello"


def token_buckets(token_budget: int) -> list[int]:
    """The padded token counts of the ragged steps an engine with this budget runs."""
    smallest, largest = ragged_token_bucket(1), ragged_token_bucket(token_budget)
    return [1 << j for j in range(smallest.bit_length() - 1, largest.bit_length())]


def row_buckets(max_batch_size: int) -> list[int]:
    """The padded row counts of its decode bursts."""
    return [1 << j for j in range(batch_bucket(max_batch_size).bit_length())]


def warm_up(engine, tokenizer, mode: str = "buckets") -> None:
    """Run the warm-up `mode` (one of WARM_UPS) on `engine`. Its requests are greedy and
    ignore the end of sequence, so each runs the steps it was sized for."""
    options = engine.options
    steps = options.steps_per_sync
    if mode == "one":
        engine.generate([tokenizer.encode(WARMUP_TEXT)], [_settings(steps + 2)])
        return
    longest = min(options.prefill_chunk, engine.backend.context_limit - 1)
    filler = tokenizer.encode(f" {WARMUP_TEXT}")[-1]
    for i, tokens in enumerate(token_buckets(options.token_budget)):
        # Its number in the first page: no two prompts share a page the cache could reuse.
        start = tokenizer.encode(f"Warm-up request {i}:")
        length = min(tokens, longest)
        engine.generate([(start + [filler] * length)[:length]], [_settings(1)])
    for rows in row_buckets(options.max_batch_size):
        prompts = [tokenizer.encode(WARMUP_TEXT)] * rows  # under a page: never cached
        engine.generate(prompts, [_settings(steps + 2)] * rows)


def _settings(new_tokens: int) -> RequestSettings:
    return RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)
