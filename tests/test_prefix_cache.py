"""Prefix caching (etjax/cache/prefix_cache.py): the index on its own, with hand-computed
contents, then the engine over the mock device, which keeps the token in every slot of every
page and so checks that a row's pages hold its whole context, shared pages included, and that
no page another row reads is ever written (tests/engine_mock.py)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import etjax
from etjax.buckets import pages_bucket
from etjax.cache.page_allocator import OutOfPagesError
from etjax.cache.prefix_cache import PrefixCache
from etjax.engine.sequence import Status
from etjax.engine_build import workload_pages
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RequestSettings, RuntimeOptions
from tests import compile_level
from tests.engine_mock import PAGE, K, mock_engine, token_of
from tests.hypothesis_profiles import examples
from tests.model_runner import full_logits

# Two pages of a document, in pages of PAGE = 4 tokens.
DOC = [101, 102, 103, 104, 105, 106, 107, 108]


def _cache(pages=9, enabled=True) -> PrefixCache:
    return PrefixCache(pages, PAGE, enabled)


def test_a_context_finds_the_pages_another_wrote_and_stops_at_the_first_difference():
    cache = _cache()
    pages = cache.allocate(3)
    held = cache.publish([], pages, [*DOC, 1, 2])  # two full pages and a partial one
    assert [e.page for e in held] == pages[:2]
    assert cache.lookup([*DOC, 9], 2).pending  # written by nobody yet: wait
    cache.mark_written(held, 5)  # the first page only
    found = cache.lookup([*DOC, 9], 2)
    assert [e.page for e in found.pages] == pages[:1] and found.pending
    cache.mark_written(held, 10)
    assert [e.page for e in cache.lookup([*DOC, 9], 2).pages] == pages[:2]
    # The second page is named by the first: the same four tokens after another page miss.
    assert cache.lookup([0, 0, 0, 0, *DOC[4:]], 2).pages == []
    assert [e.page for e in cache.lookup([*DOC[:4], 9, 9, 9, 9], 2).pages] == pages[:1]
    assert len(cache.lookup(DOC, 1).pages) == 1  # at most max_pages


def test_released_pages_stay_cached_idle_and_count_as_free():
    cache = _cache(pages=9)
    pages = cache.allocate(3)
    held = cache.publish([], pages, [*DOC, 1, 2])
    cache.mark_written(held, 10)
    assert cache.num_free == 5 and cache.num_held == 3
    cache.release(held, pages, [*DOC, 1, 2], written=10)
    # The partial page went back to the free list, the full ones are idle in the index.
    assert cache.num_free == 8 and cache.num_held == 0 and cache.num_cached == 2
    cache.check([])
    found = cache.lookup([*DOC, 7], 2)
    assert found.idle == 2
    cache.take(found.pages)
    assert cache.num_free == 6 and cache.num_held == 2
    cache.check([found.pages])


def test_release_publishes_the_full_pages_a_sequence_wrote_beyond_its_prompt():
    cache = _cache()
    pages = cache.allocate(3)
    held = cache.publish([], pages, DOC[:6])  # a prompt of 6: one full page
    assert len(held) == 1
    cache.mark_written(held, 6)
    # It generated 4 tokens; all but the last were written: tokens 0..8, two full pages.
    tokens = [*DOC, 1, 2]
    cache.release(held, pages, tokens, written=9)
    assert [e.page for e in cache.lookup([*tokens, 3], 4).pages] == pages[:2]


def test_a_pending_page_whose_owner_leaves_is_dropped():
    cache = _cache()
    pages = cache.allocate(2)
    held = cache.publish([], pages, DOC)
    cache.mark_written(held, 4)  # preempted after one page
    cache.release(held, pages, DOC, written=4)
    found = cache.lookup([*DOC, 1], 2)
    assert [e.page for e in found.pages] == pages[:1] and not found.pending
    cache.check([])


def test_eviction_takes_the_least_recently_released_and_leaves_before_parents():
    cache = _cache(pages=7)  # six usable pages
    a, b = DOC, [201, 202, 203, 204, 205, 206, 207, 208]
    for doc in (a, b):
        pages = cache.allocate(2)
        held = cache.publish([], pages, doc)
        cache.mark_written(held, 8)
        cache.release(held, pages, doc, written=8)
    assert cache.num_cached == 4 and cache.allocator.num_free == 2
    cache.allocate(3)  # one eviction: a's second page, the oldest leaf
    assert len(cache.lookup([*a, 1], 2).pages) == 1
    assert len(cache.lookup([*b, 1], 2).pages) == 2
    cache.allocate(2)  # then a's first, then b's second
    assert cache.lookup([*a, 1], 2).pages == []
    assert len(cache.lookup([*b, 1], 2).pages) == 1
    assert cache.evictions == 3
    with pytest.raises(OutOfPagesError, match="need 2 pages, 1 free or evictable"):
        cache.allocate(2)


def test_a_disabled_cache_is_a_free_list():
    cache = _cache(enabled=False)
    pages = cache.allocate(2)
    assert cache.publish([], pages, DOC) == []
    cache.release([], pages, DOC, written=8)
    assert cache.num_cached == 0 and cache.num_free == 8
    assert cache.lookup([*DOC, 1], 2).pages == []


# The engine over the mock. Prompts carry their request id last (id_at=-1), so prompts that
# share a beginning still decode tokens of their own.


def _asking(doc: list[int], request_id: int) -> list[int]:
    return [*doc, request_id]


def _run(prompts, new=6, prefix_cache=True, **kw):
    engine, backend = mock_engine(
        "fcfs", batch=4, resident=4, prefill_chunk=32, prefix_cache=prefix_cache, id_at=-1, **kw
    )
    handles = [engine.submit(p, RequestSettings(new)) for p in prompts]
    engine.run_until_idle()
    for p, h in zip(prompts, handles, strict=True):
        assert h.result().token_ids == [token_of(p[-1], i) for i in range(new)]
    assert engine.pages_in_use == 0
    engine.page_cache.check([])
    return engine, backend, [h.sequence for h in handles]


def test_questions_on_one_document_prefill_it_once():
    doc = list(range(100, 130))  # 30 tokens: seven full pages and a partial one
    prompts = [_asking(doc, r) for r in range(1, 6)]
    _, backend, seqs = _run(prompts)
    # The first prefills all 31 tokens; the others wait for its pages and prefill the rest
    # of their context past its seven full pages: 31 - 28 = 3 tokens each.
    assert backend.prefill_tokens == 31 + 4 * 3
    assert [s.cached_tokens for s in seqs] == [0] + [28] * 4
    assert [s.output.metrics["cached_tokens"] for s in seqs] == [0.0] + [28.0] * 4
    _, off, seqs = _run(prompts, prefix_cache=False)
    assert off.prefill_tokens == 5 * 31 and all(s.cached_tokens == 0 for s in seqs)


def test_the_pool_counts_a_shared_prompt_page_once():
    # decode(prompt, n=8) of a 2,050-token prompt, 64 new tokens, pages of 16: the 128 full
    # pages before the last token are one prompt's; each sample holds its own last page, its
    # output and a burst: ceil((2050 + 64 + 8) / 16) - 128 = 5 pages.
    options = RuntimeOptions(page_size=16)
    prompt, request = list(range(1000, 3050)), RequestSettings(64)
    assert workload_pages([prompt] * 8, [request] * 8, options) == pages_bucket(128 + 8 * 5 + 1)
    off = dataclasses.replace(options, prefix_cache=False)
    assert workload_pages([prompt] * 8, [request] * 8, off) == pages_bucket(8 * 133 + 1)
    # Prompts that differ in their first page share nothing; one asking for its prompt's
    # log-probabilities prefills (and holds) every page itself.
    other = [7, *prompt[1:]]
    assert workload_pages([prompt, other], [request] * 2, options) == pages_bucket(2 * 133 + 1)
    logprobs = RequestSettings(64, prompt_logprobs=True)
    assert workload_pages([prompt, prompt], [request, logprobs], options) == pages_bucket(
        128 + 5 + 133 + 1
    )


def test_a_prompt_of_whole_pages_arriving_later_still_prefills_its_last_page():
    # Every page of the prompt is cached, but the first logits come from a prefill: the last
    # page is computed again (into a page of its own), never written in the shared one.
    doc = list(range(100, 107))  # with the id: 8 tokens, two full pages
    engine, backend = mock_engine("fcfs", batch=4, resident=4, prefill_chunk=32, id_at=-1)
    engine.submit(_asking(doc, 1), RequestSettings(6)).result()
    later = engine.submit(_asking(doc, 1), RequestSettings(6))
    assert later.result().token_ids == [token_of(1, i) for i in range(6)]
    assert backend.prefill_tokens == 8 + 4 and later.sequence.cached_tokens == 4
    assert backend.forks == 0


@pytest.mark.parametrize("doc_tokens", [7, 9])  # with the id: two full pages; and a partial
def test_copies_of_a_prompt_waiting_for_it_fork_from_its_prefill(doc_tokens):
    # The n samples of one prompt: the first prefills it, the others take its last logits,
    # share its full pages and get a copy of its partial last page, prefilling nothing. The
    # mock checks the copies hold the context and that nobody writes a page another reads.
    doc = list(range(100, 100 + doc_tokens))
    _, backend, seqs = _run([_asking(doc, 1)] * 3 + [_asking(doc, 2)])
    assert backend.forks == 2
    # The first prompt whole; the other question its pages after the shared ones, and at
    # least its last token (8 tokens: the second page; 10: the third, partial).
    assert backend.prefill_tokens == {7: 8 + 4, 9: 10 + 2}[doc_tokens]
    assert [s.cached_tokens for s in seqs[1:3]] == [doc_tokens + 1] * 2


def test_the_next_turn_finds_the_previous_turn_with_its_answer():
    engine, backend = mock_engine("fcfs", batch=2, resident=2, prefill_chunk=32, id_at=-1)
    first = [*range(100, 109), 1]  # 10 tokens
    h = engine.submit(first, RequestSettings(7))
    answer = h.result().token_ids
    engine.run_until_idle()
    # Cached: 10 + 7 tokens, all but the last written: 16 tokens, four full pages.
    second = [*first, *answer, 300, 301, 2]
    before = backend.prefill_tokens
    h2 = engine.submit(second, RequestSettings(3))
    assert h2.result().token_ids == [token_of(2, i) for i in range(3)]
    assert h2.sequence.cached_tokens == 16
    assert backend.prefill_tokens - before == len(second) - 16


workloads = st.lists(
    st.tuples(
        st.integers(0, 2),  # which document the prompt starts with
        st.integers(0, 14),  # how much of it
        st.integers(0, 5),  # tokens of its own after it
        st.integers(1, 24),  # max new tokens
        st.integers(0, 6),  # the round it is submitted in
        st.one_of(st.none(), st.integers(0, 12)),  # the round its first copy is cancelled in
        st.integers(1, 3),  # copies submitted together (the n samples of one prompt: forks)
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=examples(40), deadline=None)
@given(workload=workloads, pages=st.integers(9, 24), batch=st.integers(1, 3))
def test_any_interleaving_keeps_refcounts_shares_read_only_and_leaks_nothing(
    workload, pages, batch
):
    # Random submissions (copies of one prompt among them: forks), cancellations and the
    # preemptions a small pool forces; after every round the index's counts match the live
    # sequences, no page is both free and held, the pages two live sequences share are
    # indexed entries both hold, and the mock has checked every row's pages against its
    # context and every write against the other rows' reads.
    docs = [[500 + 20 * d + i for i in range(14)] for d in range(3)]
    engine, _ = mock_engine(
        "fcfs", batch=batch, resident=batch * 2, pages=pages, rounds=2, id_at=-1
    )
    handles = {}
    for round_ in itertools.count():
        if round_ > 12 and not engine.live:
            break
        assert round_ < 2000, "the engine stopped making progress"
        for r, (doc, used, own, new, at, cancel, copies) in enumerate(workload, start=1):
            prompt = [*docs[doc][:used], *[7] * own, r]
            if at == round_ and -(-(len(prompt) + new - 1 + K) // PAGE) <= pages - 1:
                for c in range(copies):
                    handles[r, c] = (engine.submit(prompt, RequestSettings(new)), new)
            if cancel == round_ and (r, 0) in handles:
                handles[r, 0][0].cancel()
        engine.step()
        live = [s for s in engine.live if s.status in (Status.PREFILLING, Status.RUNNING)]
        engine.page_cache.check([s.held for s in live])
        owners: dict[int, list] = {}
        for s in live:
            for i, page in enumerate(s.pages):
                owners.setdefault(page, []).append(i < len(s.held))
        assert all(all(shared) for shared in owners.values() if len(shared) > 1)
        assert engine.pages_in_use == len(owners)
    for (r, _), (h, new) in handles.items():
        out = h.result()
        assert out.token_ids == [token_of(r, i) for i in range(len(out.token_ids))]
        assert out.finish_reason == "cancelled" or len(out.token_ids) == new
    assert engine.pages_in_use == 0
    engine.page_cache.check([])


# On real models, through decode(): what requests that share pages compute is what one full
# pass over their prompt and output computes.


@pytest.mark.compile_bound  # etjax's cached decode against its own full pass
def test_questions_and_samples_on_one_document_match_full_passes_on_smollm2(smollm2, lee):
    # Three greedy questions, then three seeded samples of one of them, on one 168-token
    # document (10 pages and a half: pages to share, and short full passes). Decode bursts
    # read the shared pages once for the rows holding them
    # (etjax/attention/cascade.py): the same softmax summed in another order, so a seeded
    # draw from the distribution's far tail may differ from an uncached run's in the last
    # bits. The truth is therefore the model itself: each generated token's log-probability
    # equals that of one float32 pass over prompt and output, and greedy tokens are its argmax.
    document = smollm2.tokenizer.decode(smollm2.tokenizer.encode(lee[0])[:168])
    prompts = [f"{document}\n\nQuestion: {q}\nAnswer:" for q in ("Who?", "When?", "Where?")]
    greedy = etjax.decode(prompts, model=smollm2, max_new_tokens=12)
    sampled = etjax.decode(
        prompts[0], model=smollm2, max_new_tokens=12, temperature=0.9, seed=11, n=3
    )
    results = greedy + sampled
    sequences = [r.prompt_token_ids + r.token_ids for r in results]
    ids = np.zeros((len(results), max(map(len, sequences))), np.int32)
    for b, sequence in enumerate(sequences):
        ids[b, : len(sequence)] = sequence
    # The LM head only from the first position that predicts a generated token, and this one
    # large pass compiled as users compile: it runs faster so than it compiles cheaply.
    first = min(len(r.prompt_token_ids) for r in results) - 1
    with compile_level.as_users_compile():
        logits = full_logits(smollm2.weights, smollm2.config, ids, last=ids.shape[1] - first)
    for b, r in enumerate(results):
        start = len(r.prompt_token_ids) - 1
        predicting = logits[b, start - first : start - first + len(r.token_ids)]
        log_softmax = predicting - np.log(np.exp(predicting).sum(-1, keepdims=True))
        expected = log_softmax[np.arange(len(r.token_ids)), r.token_ids]
        np.testing.assert_allclose(r.logprob, expected, atol=2e-3)
        if b < len(greedy):
            assert r.token_ids == predicting.argmax(-1).tolist()
    shared = [r.cached_tokens for r in results]
    # The first greedy request and the first sample prefill the document; the other
    # questions find its full pages (168 tokens and the question's start: at least 10
    # pages), the other samples fork from the first's prefill (the whole prompt, its partly
    # filled last page copied).
    assert shared[0] == shared[3] == 0 and min(shared[1:3]) >= 10 * 16
    assert shared[4:] == [len(sampled[0].prompt_token_ids)] * 2
    assert len(sampled[0].prompt_token_ids) % 16  # the copy was needed


def test_the_cache_keeps_outputs_with_speculation_pruning_and_sampling(tiny_hf_dir, monkeypatch):
    # Pruning reads shared pages' key bounds (the page's own) and remembers the mass each
    # block drew per row, so the default settings, mass ranking included, keep the outputs;
    # speculation writes and rolls back only unshared pages. The tiny random model copies
    # nothing, so prompt lookup would draft nothing: every round drafts its last token twice
    # instead (a stand-in for the lookup), which the model mostly rejects, so rows write
    # drafts' keys and roll them back beside shared pages.
    import etjax.engine.engine as engine_module

    monkeypatch.setattr(
        engine_module, "draft_lengths", lambda entropies, *a, **k: [2] * len(entropies)
    )
    monkeypatch.setattr(
        engine_module, "lookup_draft", lambda context, length, *a: [int(context[-1])] * length
    )
    tiny = etjax.load_model(tiny_hf_dir("llama"))
    doc = list(range(300, 400))
    prompts = [tiny.tokenizer.decode([*doc, 500 + i]) for i in range(3)]
    pruning = PruningConfig(enabled=True, min_fraction=0.3)
    assert pruning.ranks_by_mass
    outputs = {
        cache: etjax.decode(
            prompts,
            model=tiny,
            max_new_tokens=16,
            temperature=0.8,
            seed=5,
            n=2,
            pruning=pruning,
            speculation=True,
            prefix_cache=cache,
            ignore_eos=True,
        )
        for cache in (True, False)
    }
    assert [r.token_ids for r in outputs[True]] == [r.token_ids for r in outputs[False]]
    assert sum(r.cached_tokens > 0 for r in outputs[True]) >= 4
    for results in outputs.values():  # drafted, and rejected: rolled back
        assert all(r.drafted_tokens > r.accepted_tokens for r in results)
