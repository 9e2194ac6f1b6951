"""On SmolLM2: greedy outputs do not depend on the scheduling policy, the batch composition,
mixing with prefill, or preemption and recompute."""

from __future__ import annotations

import pytest

from etjax.cache.page_allocator import pages_needed
from etjax.engine_build import MIN_POOL_PAGES, build_engine, pool_pages
from etjax.runtime.options import RequestSettings, RuntimeOptions

# Preemption needs sequences that outgrow their pool while they decode: 48 tokens (at 24 to
# 40 the policy test's pool holds them all and none is preempted). A row beside a document
# being prefilled needs fewer: 9 covers the mixed step it decodes in beside the document's
# second chunk and then a burst of all five rows (8 steps; the short rows cross a page
# boundary in it).
NEW = 48
NEW_BESIDE_DOCUMENT = 9

# Both tests compare etjax with itself and compile more than they run (13 and 7 programs of
# SmolLM2), so they compile cheaply: 24.6 and 25.4 s against 31.5 and 29.2 as users compile
# (2-core Xeon, 2026-12-05; tests/compile_level.py).
pytestmark = pytest.mark.compile_bound

# The reference and the long-row runs batch as decode() does (32 rows, 256 pages for these
# workloads): other cheaply compiled SmolLM2 tests of the run (the prefix cache's,
# speculation's, the server's) decode through the same programs.
DECODE_OPTIONS = RuntimeOptions()


def _run(model, prompts, options: RuntimeOptions, num_pages: int, new: int = NEW):
    engine = build_engine(model.weights, model.config, model.tokenizer, options, num_pages)
    settings = [RequestSettings(new, ignore_eos=True)] * len(prompts)
    return engine.generate(prompts, settings), engine


def test_greedy_outputs_are_the_same_under_every_policy_and_batching(smollm2, lee):
    prompts = [smollm2.tokenizer.encode(lee[i])[: 40 + 50 * i] for i in range(5)]
    needs = sorted(pages_needed(len(p) + NEW + 8, 16) for p in prompts)
    reference, _ = _run(smollm2, prompts, DECODE_OPTIONS, MIN_POOL_PAGES)
    assert sum(needs) < MIN_POOL_PAGES  # every request resident at once
    reference = [o.token_ids for o in reference]
    # Two batch slots rotating over four resident sequences, in a pool that holds the largest
    # request with 6 pages to spare: sequences change batch partners every round, and the
    # short ones admitted together outgrow the pool, so some are preempted and recomputed.
    # (With 6, every prefill step, the recompute's too, is in the 256-token bucket; with 4,
    # one is in the 128-token one: a program more.) The pool is the default one with the rest
    # of its pages taken before the run (a pool of that size would compile every program
    # again for it).
    options = RuntimeOptions(
        max_batch_size=2, max_resident=4, min_advance_rounds=2, policy="entropic"
    )
    engine = build_engine(
        smollm2.weights, smollm2.config, smollm2.tokenizer, options, MIN_POOL_PAGES
    )
    aside = engine.page_cache.allocate(engine.page_cache.num_free - (needs[-1] + 6))
    outputs = engine.generate(prompts, [RequestSettings(NEW, ignore_eos=True)] * len(prompts))
    engine.page_cache.free(aside)
    rotated = [o.token_ids for o in outputs]
    assert sum(o.metrics["preemptions"] for o in outputs) >= 1
    assert rotated == reference
    assert engine.pages_in_use == 0


def test_a_long_row_beside_short_ones_decodes_as_it_does_alone(smollm2, lee):
    # Four short prompts, then a 388-token document: the short rows decode while the
    # document is prefilled in the same ragged steps (328 of its tokens beside the prompts,
    # then 60 beside four decode tokens), then all five decode together, each reading only
    # its own pages. So the dense engine never splits the batch by width (grouping.py pays
    # only under pruning), and every row's tokens equal those it gets alone. The lengths keep
    # every step in the other test's programs: its reference run's 512- and 64-token buckets
    # and 8-row bursts, batched; alone, the document's one chunk in the 512-token bucket and
    # each 46-token prompt in the 64-token one. (An 800-token document, its last 472 tokens
    # beside the rows, proved no more in two more 512-token steps; a 1.6K-token one in 29.0
    # CPU s against 20.7: AMD EPYC (Zen 4), 2 cores, loaded, 2026-12-07.)
    prompts = [smollm2.tokenizer.encode(lee[20 + i])[:46] for i in range(4)]
    prompts.append(smollm2.tokenizer.encode("\n\n".join(lee[:12]))[:388])
    assert [len(p) for p in prompts] == [46] * 4 + [388]
    options = DECODE_OPTIONS
    # The pool decode() would size for them (all five at once).
    new = NEW_BESIDE_DOCUMENT
    pages = pool_pages([pages_needed(len(p) + new + 8, 16) for p in prompts], options)
    outputs, engine = _run(smollm2, prompts, options, pages, new)
    batched = [o.token_ids for o in outputs]
    assert engine.decode_bursts == engine.decode_rounds
    alone = [_run(smollm2, [p], options, pages, new)[0][0].token_ids for p in prompts]
    assert batched == alone
