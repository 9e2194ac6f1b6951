"""`generate_ids`: a known set of tokenized prompts through the engine, outputs in order.

The entry point of `etjax.decode()` and of most tests and benchmarks. It builds an `Engine`
over a `DeviceBackend` whose page pool is sized for the requests at hand (unless the options
fix it), and runs every request to the end (`Engine.generate`).

The pool's size is a shape of every step program, so a pool sized exactly to each call would
compile the engine anew for each new workload. Pools are rounded up to a power of two and never
fall below `MIN_POOL_PAGES`: calls of everyday sizes (a few prompts, a few thousand tokens)
share one pool size, hence one set of compiled programs, in a process and in the persistent
compilation cache.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from etjax.buckets import pages_bucket
from etjax.cache import spare_pool
from etjax.cache.page_allocator import pages_needed
from etjax.compilation_cache import use_persistent_cache
from etjax.drafting import measured_costs
from etjax.engine.device import DeviceBackend
from etjax.engine.engine import Engine
from etjax.engine.policies import make_policy
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights
from etjax.planning.pool import device_pool_pages
from etjax.runtime.options import RequestSettings, RuntimeOptions, SequenceOutput
from etjax.tokenizer import Tokenizer

__all__ = ["RequestSettings", "RuntimeOptions", "SequenceOutput", "build_engine", "generate_ids"]

TextCallback = Callable[[int, str], None]

# 4,096 tokens at the default page size of 16. The KV bytes this costs scale with the model:
# 0.2 GB for SmolLM2-135M in float32, 0.5 GB for a 7B model with 8 KV heads in bfloat16.
MIN_POOL_PAGES = 256


def build_engine(
    weights: Weights,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    options: RuntimeOptions,
    num_pages: int | None = None,
    clock: Callable[[], float] | None = None,
) -> Engine:
    """An engine on the default device; `num_pages` overrides `options.num_pages`, and
    without either the pool on a TPU fills the chips' HBM (`device_pool_pages`)."""
    use_persistent_cache(options.compilation_cache)
    pages = num_pages or options.num_pages or device_pool_pages(cfg, options, weights) or 4096
    eos = tuple(tokenizer.eos_token_ids)
    backend = DeviceBackend(weights, cfg, eos, options, pages)
    cost = backend.cost  # the one cost model of this engine's model, KV dtype and pages
    policy = make_policy(
        options.policy,
        cost.weight_bytes,
        cost.kv_bytes_per_key,
        options.max_batch_size,
        options.page_size,
        options.speculation.pass_fixed_tokens,
    )
    kwargs = {} if clock is None else {"clock": clock}
    # What the engine's steps cost on this machine, measured by the engines of this process
    # that run the same programs (etjax/drafting/costs.py); the cost gate reads it.
    shape = (cfg, backend.attention_backend, backend.kv_dtype, options.pruning, options.mesh)
    costs = measured_costs(repr((*shape, options.experts, backend.max_draft)))
    return Engine(backend, tokenizer, options, policy, step_costs=costs, **kwargs)


def request_pages(prompt_tokens: int, settings: RequestSettings, options: RuntimeOptions) -> int:
    """The pages one request can come to hold: its prompt, its output and a burst to spare."""
    length = prompt_tokens + settings.max_new_tokens + options.steps_per_sync
    return pages_needed(length, options.page_size)


def pool_pages(needs: Iterable[int], options: RuntimeOptions) -> int:
    """A pool that holds the largest of these requests at once, up to the resident limit
    (the null page included), rounded up to a power of two and at least `MIN_POOL_PAGES`."""
    return pages_bucket(max(sum(heapq.nlargest(options.resident_rows, needs)) + 1, MIN_POOL_PAGES))


def workload_pages(
    prompts: Sequence[Sequence[int]], settings: Sequence[RequestSettings], options: RuntimeOptions
) -> int:
    """A pool that holds every request at once, up to the resident limit (bucketed). With
    the prefix cache, a prompt page that several requests start with is counted once (the
    n samples of `decode(n=...)` need one prompt's pages, not n)."""
    pairs = list(zip(prompts, settings, strict=True))
    if not options.prefix_cache:
        return pool_pages((request_pages(len(p), s, options) for p, s in pairs), options)
    ps = options.page_size
    shared: dict[tuple, int] = {}  # (parent page's id, page tokens) -> id: the prefix tree
    own = []
    for prompt, request in pairs:
        # The full pages admission can take from the cache (engine.py `_admit`): all but the
        # one holding the last token, none where the prompt's log-probabilities are asked.
        cached = 0 if request.prompt_logprobs else (len(prompt) - 1) // ps
        node = -1
        for k in range(cached):
            node = shared.setdefault((node, tuple(prompt[k * ps : (k + 1) * ps])), len(shared))
        own.append(request_pages(len(prompt), request, options) - cached)
    largest = sum(heapq.nlargest(options.resident_rows, own))
    return pages_bucket(max(largest + len(shared) + 1, MIN_POOL_PAGES))


def generate_ids(
    weights: Weights,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[RequestSettings],
    options: RuntimeOptions | None = None,
    on_text: TextCallback | None = None,
    on_done: Callable[[int, SequenceOutput], None] | None = None,
) -> list[SequenceOutput]:
    """Generate a continuation for each tokenized prompt (already validated).

    `on_text(i, piece)` receives the text of prompt i as it is produced, `on_done(i, output)`
    each output as it completes. Returns one
    `SequenceOutput` per prompt, in order.
    """
    options = options or RuntimeOptions()
    pages = options.num_pages or device_pool_pages(cfg, options, weights)
    pages = pages or workload_pages(prompts, settings, options)
    engine = build_engine(weights, cfg, tokenizer, options, num_pages=pages)
    outputs = engine.generate(prompts, settings, on_text=on_text, on_done=on_done)
    if engine.backend.placement is None:  # the next call's engine takes its pool
        spare_pool.give_back(weights, engine.backend.cache)
    return outputs
