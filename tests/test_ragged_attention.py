"""Ragged paged attention (pallas_kernels/ragged_attention) against its float32 reference, over
ragged batches drawn by hypothesis: one-token and long sequences, chunks that continue a cached
prefix and cross page boundaries, decode bursts whose items reach past the current position,
GQA, float32 and bfloat16 caches, with and without a sliding window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_attention import Segment, build_pass, ragged_attention_xla
from pallas_kernels.ragged_attention.work_items import items_capacity
from tests.hypothesis_profiles import examples
from tests.kernel_references import ragged_attention_reference

# Relative to max |out|: float32 differs from the reference only by summation order; bfloat16
# queries and pages are rounded once before either computes in float32.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-5}
CHUNK = 8
# As the engine runs it, inside a compiled program: called eagerly, each call's loop bodies
# are new closures, so every example would compile its loops again.
_xla_jitted = jax.jit(ragged_attention_xla, static_argnums=5)


# Shapes are padded to these bounds so that each (page size, heads, dtype, tiles) compiles once.
MAX_SEQS, MAX_CACHED, MAX_NEW, MAX_EXTRA = 5, 70, 40, 5
# (page size, (KV heads, query heads per KV head), dtype, (query tile, KV tile)): every pair of
# values of any two fields occurs (a covering array: five programs where every combination
# would be sixteen); the batches drawn vary within each.
SHAPES = [
    (4, (1, 1), jnp.float32, (1, 2)),
    (4, (2, 3), jnp.bfloat16, (16, 4)),
    (16, (1, 1), jnp.bfloat16, (16, 4)),
    (16, (2, 3), jnp.float32, (16, 4)),
    (16, (2, 3), jnp.bfloat16, (1, 2)),
]


def _case(draw_lengths, page_size, kvh, groups, hd, dtype, q_tile, kv_tile, extra, seed, window=0):
    # draw_lengths: (cached, new) per sequence; returns the inputs of both backends.
    rng = np.random.default_rng(seed)
    h = kvh * groups
    need = [-(-(c + n + extra) // page_size) for c, n in draw_lengths]
    most = -(-(MAX_CACHED + MAX_NEW + MAX_EXTRA) // page_size)
    num_pages = MAX_SEQS * most + 3
    order = rng.permutation(np.arange(1, num_pages))  # pages scattered through the pool
    pages, taken = [], 0
    for k in need:
        pages.append(order[taken : taken + k].tolist())
        taken += k
    k_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, page_size, hd)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, page_size, hd)), dtype)
    num_tokens = MAX_SEQS * MAX_NEW + 3  # trailing padding tokens
    q = jnp.asarray(rng.normal(size=(num_tokens, h, hd)) * 2.0, dtype)
    positions = np.full(num_tokens, -1, np.int32)
    token_seq = np.full(num_tokens, -1, np.int32)
    segments, start = [], 0
    for s, ((cached, new), seq_pages) in enumerate(zip(draw_lengths, pages, strict=True)):
        positions[start : start + new] = cached + np.arange(new)
        token_seq[start : start + new] = s
        segments.append(Segment(start, new, cached, cached + new - 1 + extra, seq_pages))
        start += new
    width = most
    table = np.zeros((MAX_SEQS, width), np.int32)
    for s, seq_pages in enumerate(pages):
        table[s, : len(seq_pages)] = seq_pages
    max_tiles = MAX_SEQS * -(-MAX_NEW // q_tile)
    max_items = items_capacity(max_tiles * (width // kv_tile + 1), CHUNK)
    tile_pass = build_pass(
        segments,
        page_size=page_size,
        q_tile=q_tile,
        kv_tile=kv_tile,
        num_tokens=num_tokens,
        max_tiles=max_tiles,
        max_items=max_items,
        window=window,
    )
    return q, k_pages, v_pages, positions, token_seq, table, tile_pass


def _xla_and_reference(case, window: int) -> tuple[np.ndarray, np.ndarray]:
    # Both backends on one `_case`, as float32 host arrays. The window is traced: one
    # program serves local and global layers.
    q, k_pages, v_pages, positions, token_seq, table, tile_pass = case
    positions = jnp.asarray(positions)
    ours = _xla_jitted(q, k_pages, v_pages, positions, (tile_pass,), CHUNK, jnp.int32(window))
    truth = ragged_attention_reference(
        q, k_pages, v_pages, positions, jnp.asarray(token_seq), jnp.asarray(table), window
    )
    return np.asarray(ours, np.float32), np.asarray(truth)


@settings(max_examples=examples(40))
@given(
    lengths=st.lists(
        st.tuples(st.integers(0, MAX_CACHED), st.integers(1, MAX_NEW)),
        min_size=1,
        max_size=MAX_SEQS,
    ),
    shape=st.sampled_from(SHAPES),
    extra=st.integers(0, MAX_EXTRA),
    seed=st.integers(0, 2**16),
    window=st.sampled_from([0, 5, 19]),
)
def test_xla_matches_the_reference_on_any_ragged_batch(lengths, shape, extra, seed, window):
    page_size, heads, dtype, tiles = shape
    kvh, groups = heads
    case = _case(lengths, page_size, kvh, groups, 16, dtype, *tiles, extra, seed, window)
    ours, truth = _xla_and_reference(case, window)
    token_seq = case[4]
    scale = np.max(np.abs(truth))
    tolerance = TOLERANCE[dtype] if dtype == jnp.float32 else 1e-2  # output rounded to bf16
    assert np.max(np.abs(ours - truth)) <= tolerance * scale
    assert np.all(ours[token_seq < 0] == 0)


@pytest.mark.parametrize(
    ("cached", "window"),
    [
        (15, 0),  # queries 15..30: key tile 0..15 is wholly visible, the unmasked path
        (14, 0),  # queries 14..29: key 15 is one past the first query: masked
        (48, 40),  # queries 48..63 see from 24 on: key tile 32..47 unmasked, 16..31 masked
        (48, 31),  # queries 48..63, query 63 sees from 33 on: key tile 32..47 masked
    ],
)
def test_the_tile_loop_masks_exactly_at_the_visibility_boundaries(cached, window):
    # Items of a wide tile whose keys every query sees skip the mask (xla.py): these chunks
    # put an item's last key at, and one past, the tile's first query, and an item's first
    # key at, and just inside, the window of the tile's last query (pages of 16, key tiles
    # of 16 positions, query tiles of 16).
    case = _case([(cached, 16)], 16, 2, 3, 16, jnp.float32, 16, 1, 0, 7, window)
    ours, truth = _xla_and_reference(case, window)
    assert np.max(np.abs(ours - truth)) <= TOLERANCE[jnp.float32] * np.abs(truth).max()


@pytest.mark.parametrize(("q_tile", "kv_tile"), [(1, 2), (16, 1)])  # both loop shapes
def test_soft_capped_scores_match_the_reference(q_tile, kv_tile):
    # Gemma 2 caps scores s at softcap * tanh(s / softcap) before the softmax: a decode-like
    # and a chunk-like pass, a cached prefix and a window, against the float32 truth. Queries
    # of scale 2 give scores of several units, which a cap of 2 squashes visibly.
    softcap, window = 2.0, 19
    case = _case([(40, 16), (3, 9)], 4, 2, 3, 16, jnp.float32, q_tile, kv_tile, 0, 11, window)
    q, k_pages, v_pages, positions, token_seq, table, tile_pass = case
    positions = jnp.asarray(positions)
    run = jax.jit(ragged_attention_xla, static_argnums=(5, 7))
    ours = run(q, k_pages, v_pages, positions, (tile_pass,), CHUNK, jnp.int32(window), softcap)
    truth, uncapped = (
        ragged_attention_reference(
            q, k_pages, v_pages, positions, jnp.asarray(token_seq), jnp.asarray(table), window, cap
        )
        for cap in (softcap, 0.0)
    )
    scale = np.abs(np.asarray(truth)).max()
    assert np.max(np.abs(np.asarray(ours) - truth)) <= TOLERANCE[jnp.float32] * scale
    assert np.max(np.abs(np.asarray(uncapped) - truth)) > 1e-2 * scale


def test_a_prefill_chunk_reads_only_its_causal_part():
    # A 64-token chunk after 64 cached tokens, pages of 8, query tiles of 16 and key tiles of
    # one page: tile j (positions 64 + 16j .. 64 + 16j + 15) sees pages 0 .. 9 + 2j, so the
    # pass holds 10 + 12 + 14 + 16 = 52 items, not 4 x 16 (the padded square).
    pages = list(range(1, 17))
    tile_pass = build_pass(
        [Segment(0, 64, 64, 127, pages)],
        page_size=8,
        q_tile=16,
        kv_tile=1,
        num_tokens=64,
        max_tiles=4,
        max_items=64,
    )
    assert int(tile_pass.num_items) == 52
    assert list(np.bincount(tile_pass.item_tile[:52])) == [10, 12, 14, 16]


def test_a_sliding_window_lists_only_the_key_tiles_it_can_see():
    # The same chunk with a window of 20 positions: tile j's first query (64 + 16j) sees from
    # 45 + 16j on, so its key tiles start at page 5 + 2j: 5 + 5 + 5 + 5 = 20 items.
    pages = list(range(1, 17))
    tile_pass = build_pass(
        [Segment(0, 64, 64, 127, pages)],
        page_size=8,
        q_tile=16,
        kv_tile=1,
        num_tokens=64,
        max_tiles=4,
        max_items=64,
        window=20,
    )
    assert int(tile_pass.num_items) == 20
    for j in range(4):
        mine = tile_pass.item_tile[:20] == j
        assert tile_pass.item_key_start[:20][mine].tolist() == [
            8 * (5 + 2 * j + i) for i in range(5)
        ]
        assert tile_pass.item_pages[:20][mine, 0].tolist() == pages[5 + 2 * j : 10 + 2 * j]
    # A decode row at position 99 with a window of 20 reads positions 80..99: pages 10-12.
    decode = build_pass(
        [Segment(0, 1, 99, 99, pages)],
        page_size=8,
        q_tile=1,
        kv_tile=2,
        num_tokens=1,
        max_tiles=1,
        max_items=8,
        window=20,
    )
    assert int(decode.num_items) == 2
    assert decode.item_pages[:2].tolist() == [[pages[10], pages[11]], [pages[12], pages[13]]]


def test_a_segment_whose_pages_do_not_cover_its_reach_is_refused():
    with pytest.raises(ValueError, match="do not cover position 16"):
        build_pass(
            [Segment(0, 1, 15, 16, [3])],
            page_size=16,
            q_tile=1,
            kv_tile=1,
            num_tokens=1,
            max_tiles=1,
            max_items=8,
        )


def test_attend_runs_the_local_plan_on_sliding_window_layers():
    # One plan for a model with local and global layers: `attend(local=...)`, traced as in the
    # layer scan, runs the windowed passes and mask for local layers and the whole context
    # for global ones; the local passes list fewer items.
    import jax

    from etjax.attention import attend
    from etjax.attention.plan import PlanSizes, plan_segments

    window, page_size = 11, 4
    lengths = [(MAX_CACHED, 1), (17, 30), (3, 1)]
    q, k_pages, v_pages, positions, token_seq, table, _ = _case(
        lengths, page_size, 2, 3, 16, jnp.float32, 1, 4, 0, seed=5
    )
    segments, start = [], 0
    for s, (cached, new) in enumerate(lengths):
        pages = table[s, : (cached + new - 1) // page_size + 1].tolist()
        segments.append(Segment(start, new, cached, cached + new - 1, pages))
        start += new
    rows, width = len(lengths), table.shape[1]
    sizes = PlanSizes(
        page_size,
        PlanSizes.decode(rows, MAX_SEQS * width, page_size).passes
        + PlanSizes.prefill(q.shape[0], rows, width, page_size).passes,
    )
    plan = plan_segments(segments, q.shape[0], sizes, window=window)
    assert sum(int(p.num_items) for p in plan.local) < sum(int(p.num_items) for p in plan.passes)

    run = jax.jit(lambda local: attend(q, k_pages, v_pages, jnp.asarray(positions), plan, 0, local))
    for local, seen in ((True, window), (False, 0)):
        truth = ragged_attention_reference(
            q,
            k_pages,
            v_pages,
            jnp.asarray(positions),
            jnp.asarray(token_seq),
            jnp.asarray(table),
            seen,
        )
        ours = np.asarray(run(jnp.bool_(local)))
        assert np.max(np.abs(ours - np.asarray(truth))) <= 2e-5 * np.max(np.abs(truth))
