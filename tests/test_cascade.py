"""Cascade attention (etjax/attention/cascade.py): decode rows that start with the same pages
read them once, in a shared pass merged with each row's own by log-sum-exp.

Truths: the grouping by hand; the kernel against its float32 reference (one dense softmax per
token over its page table); the engine's decode bursts against one full pass of the tiny
model over prompt and output."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import etjax
from etjax.attention import PlanSizes, plan_decode, plan_segments
from etjax.attention import cascade as cascade_module
from etjax.attention.cascade import blocks_read_for_others, shared_prefixes
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.entropy.estimators import exact_entropy
from pallas_kernels.ragged_attention import (
    Segment,
    ragged_attention_reference,
    ragged_attention_xla,
)
from pallas_kernels.ragged_attention.cpu import ragged_pass_cpu
from tests.model_runner import full_logits


def test_rows_are_grouped_by_their_common_whole_key_tiles():
    # Pages of 4 tokens, key tiles of 2 pages. Rows 0-2 start with pages 1, 2, 3; row 2's
    # position (13) is in its page 3, so only pages 1-2 are whole for all three: one tile.
    segments = [
        Segment(0, 1, 22, 22, [1, 2, 3, 4, 5, 9]),
        Segment(1, 1, 22, 22, [1, 2, 3, 4, 6, 10]),
        Segment(2, 1, 13, 13, [1, 2, 3, 7]),
        Segment(3, 1, 5, 5, [11, 12]),
    ]
    own, prefixes = shared_prefixes(segments, page_size=4, kv_tile=2)
    assert [(list(p.tokens), list(p.pages)) for p in prefixes] == [([0, 1, 2], [1, 2])]
    assert [s.skip_pages for s in own] == [2, 2, 2, 0]
    # What each row's step is spared: 2 pages read once for 3 rows, a third of them its own.
    np.testing.assert_allclose(blocks_read_for_others(prefixes, 5), [4 / 3] * 3 + [0, 0])
    # Two rows share four pages (two key tiles), when two are enough for a tile (by default
    # they are not); a tile of at most 2 rows splits three.
    assert shared_prefixes(segments[:2], page_size=4, kv_tile=2)[1] == []
    pair = {"page_size": 4, "kv_tile": 2, "min_rows": 2}
    own, prefixes = shared_prefixes(segments[:2], **pair)
    assert [list(p.pages) for p in prefixes] == [[1, 2, 3, 4]]
    own, prefixes = shared_prefixes(segments, q_tile=2, **pair)
    assert [list(p.tokens) for p in prefixes] == [[0, 1]]  # row 2 is left alone
    # Capacities: no prefix past max_items key tiles.
    assert shared_prefixes(segments[:2], max_items=1, **pair)[1] == []


def test_shared_pass_matches_the_reference():
    page, kvh, groups, hd = 4, 2, 3, 16
    rng = np.random.default_rng(0)
    num_pages = 64
    k_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, page, hd)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, page, hd)), jnp.float32)
    # Five rows over a 12-page shared beginning (two of them also share two pages more),
    # one row alone, and rows at different lengths past the prefix.
    shared = list(range(1, 13))
    tables = [
        [*shared, 20, 21],
        [*shared, 20, 21, 22],
        [*shared, 23],
        [*shared, 24, 25, 26],
        [*shared, 27],
        [40, 41, 42],
    ]
    lengths = [55, 58, 49, 57, 50, 10]  # positions of each row's token
    rows = len(tables)
    q = jnp.asarray(rng.normal(size=(8, kvh * groups, hd)) * 2.0, jnp.float32)
    positions = np.full(8, -1, np.int32)
    positions[:rows] = lengths
    segments = [
        Segment(j, 1, n, n, t[: n // page + 1])
        for j, (n, t) in enumerate(zip(lengths, tables, strict=True))
    ]
    sizes = PlanSizes.decode(8, num_pages, page, max_seq_pages=16, pages_shared=True, cascade=True)
    plan = plan_decode(segments, 8, sizes)
    assert plan.shared and int(plan.passes[-1].num_items) == 3  # 12 pages: 3 key tiles, once
    plain_sizes = PlanSizes.decode(8, num_pages, page, max_seq_pages=16, pages_shared=True)
    plain = plan_segments(segments, 8, plain_sizes)
    table = np.zeros((8, 16), np.int32)
    for j, t in enumerate(tables):
        table[j, : len(t)] = t
    token_seq = np.where(np.arange(8) < rows, np.arange(8), -1).astype(np.int32)
    want = ragged_attention_reference(q, k_pages, v_pages, positions, token_seq, table)
    run = jax.jit(
        ragged_attention_xla, static_argnums=5, static_argnames=("shared_last", "native_pass")
    )
    # The XLA loops, and the CPU kernel (its passes and the shared one).
    for native_pass, p in itertools.product((None, ragged_pass_cpu), (plan, plain)):
        got = run(
            q, k_pages, v_pages, jnp.asarray(positions), p.passes, p.chunk,
            shared_last=p.shared, native_pass=native_pass,
        )  # fmt: skip
        scale = float(jnp.max(jnp.abs(want[:rows])))
        assert float(jnp.max(jnp.abs(got[:rows] - want[:rows]))) < 2e-5 * scale


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def test_decode_bursts_over_a_shared_prefix_match_full_passes(tiny, monkeypatch):
    # Four prompts after one 40-token beginning: with the prefix cache they share its full
    # pages, and the decode bursts read them once. Every greedy token, entropy and
    # log-probability must equal one full pass over prompt and output.
    found = []
    group = cascade_module.shared_prefixes

    def recording(*args, **kwargs):
        own, prefixes = group(*args, **kwargs)
        found.extend(len(p.tokens) for p in prefixes)
        return own, prefixes

    monkeypatch.setattr("etjax.attention.plan.shared_prefixes", recording)
    rng = np.random.default_rng(11)
    beginning = rng.integers(3, tiny.config.vocab_size, 40).tolist()
    prompts = [
        beginning + rng.integers(3, tiny.config.vocab_size, k).tolist() for k in (1, 3, 6, 9)
    ]
    new = 10
    options = RuntimeOptions(page_size=4, steps_per_sync=4, prefill_chunk=16, max_batch_size=4)
    settings = [RequestSettings(max_new_tokens=new, ignore_eos=True)] * len(prompts)
    outs = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)
    assert found and max(found) == 4  # the four rows read the beginning together
    # What a token's step read once for its group: the beginning's 10 full pages cut to
    # whole key tiles of 4 pages (8), less the row's share (1/4 of 4 rows, 1/3 of 3); a
    # token of a step that shared nothing (the first, from a ragged step) is spared nothing.
    for out in outs:
        assert len(out.shared_blocks) == new
        assert set(np.round(out.shared_blocks, 4)) <= {0.0, 6.0, round(8 * 2 / 3, 4)}
        assert 6.0 in out.shared_blocks
    # One full pass over the four sequences, padded at the end (causal: the padding is read
    # by no position before it), compiled once.
    sequences = [prompt + out.token_ids for prompt, out in zip(prompts, outs, strict=True)]
    ids = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
    logits = full_logits(tiny.weights, tiny.config, ids, page_size=4)
    for row, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        predicting = logits[row, len(prompt) - 1 : len(prompt) - 1 + new]
        np.testing.assert_array_equal(predicting.argmax(-1), out.token_ids)
        np.testing.assert_allclose(out.entropy, exact_entropy(predicting), rtol=1e-4, atol=1e-5)
