"""The pruning building blocks: budget, Quest key bounds, block selection."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.pruning.block_scores import remember_mass, update_key_bounds
from etjax.pruning.budget import kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.pruning.groups import PrunedGroups, grouped_blocks, select_grouped
from etjax.pruning.selection import select_blocks
from pallas_kernels.page_scores.reference import block_upper_bounds
from tests.hypothesis_profiles import examples

CFG = PruningConfig(enabled=True, min_fraction=0.25, entropy_low=1.0, entropy_high=3.0)
# Jitted once, as the step programs run them: called eagerly, each of their operations would
# compile on its own for every shape.
_block_upper_bounds = jax.jit(block_upper_bounds)
_update_key_bounds = jax.jit(update_key_bounds)
_remember_mass = jax.jit(remember_mass)
_select_blocks = jax.jit(select_blocks, static_argnums=(3, 4))  # the config, max_kept
_select_grouped = jax.jit(select_grouped, static_argnums=(0, 5, 6))  # kernel, config, max_kept
_grouped_blocks = jax.jit(grouped_blocks, static_argnums=3)  # the config


@settings(max_examples=examples(100), deadline=None)
@given(st.floats(0, 20), st.floats(0, 20))
def test_kept_fraction_is_monotone_and_bounded(h1, h2):
    lo, hi = sorted((h1, h2))
    f_lo, f_hi = (float(kept_fraction(jnp.asarray([h]), CFG)[0]) for h in (lo, hi))
    assert f_lo <= f_hi + 1e-7
    assert CFG.min_fraction - 1e-7 <= f_lo and f_hi <= 1.0 + 1e-7


def test_kept_fraction_by_hand():
    f = kept_fraction(jnp.asarray([0.0, 1.0, 2.0, 3.0, 9.0]), CFG)
    np.testing.assert_allclose(np.asarray(f), [0.25, 0.25, 0.625, 1.0, 1.0], rtol=1e-6)


def test_kept_block_count_floors():
    counts = kept_block_count(jnp.asarray([0.1, 0.5, 1.0, 0.1]), jnp.asarray([100, 7, 9, 2]), CFG)
    # ceil(10) = 10; ceil(3.5) = 4 (floor: max(min_blocks 4, 1 sink + 2 recent)); all 9; 2 exist.
    np.testing.assert_array_equal(np.asarray(counts), [10, 4, 9, 2])


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="min_fraction"):
        PruningConfig(min_fraction=0.0)
    with pytest.raises(ValueError, match="entropy_low"):
        PruningConfig(entropy_low=3.0, entropy_high=1.0)
    with pytest.raises(ValueError, match=r"signal='tail'.*exact"):
        PruningConfig(signal="tail")
    with pytest.raises(ValueError, match="mass_threshold"):
        PruningConfig(mass_threshold=1.5)


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3]), st.sampled_from([1, 3]))
def test_block_bound_is_an_upper_bound_of_every_logit(seed, kvh, group):
    rng = np.random.default_rng(seed)
    num_pages, ps, hd, width = 6, 4, 8, 3
    keys = rng.normal(size=(num_pages, kvh, ps, hd)).astype(np.float32) * rng.uniform(0.1, 5)
    k_min, k_max = keys.min(axis=2), keys.max(axis=2)
    q = rng.normal(size=(2, kvh * group, hd)).astype(np.float32)
    table = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
    bound = np.asarray(_block_upper_bounds(q, k_min, k_max, table))
    for b in range(2):
        for h in range(kvh):
            for j in range(width):
                page_keys = keys[table[b, j], h]  # [ps, hd]
                logits = q[b, h * group : (h + 1) * group] @ page_keys.T / np.sqrt(hd)
                assert logits.max() <= bound[b, h, j] + 1e-4


def test_key_bounds_track_pages_as_they_fill_and_are_reused():
    rng = np.random.default_rng(0)
    n, kvh, hd = 5, 2, 4  # pages of 3 slots
    k_min = jnp.full((n, kvh, hd), jnp.inf)
    k_max = jnp.full((n, kvh, hd), -jnp.inf)
    contents: dict[int, list[np.ndarray]] = {}
    # A prefill of 5 tokens over pages 1, 2, then two decode tokens, then page 1 reused.
    writes = [([1, 1, 1, 2, 2], [0, 1, 2, 0, 1]), ([2], [2]), ([3], [0]), ([1, 1], [0, 1])]
    for pages, slots in writes:
        keys = rng.normal(size=(len(pages), kvh, hd)).astype(np.float32)
        for key, page, slot in zip(keys, pages, slots, strict=True):
            if slot == 0:
                contents[page] = []
            contents[page].append(key)
        k_min, k_max = _update_key_bounds(
            k_min, k_max, keys, np.asarray(pages, np.int32), np.asarray(slots, np.int32)
        )
    for page, held in contents.items():
        np.testing.assert_allclose(np.asarray(k_min[page]), np.min(held, axis=0))
        np.testing.assert_allclose(np.asarray(k_max[page]), np.max(held, axis=0))


def test_selection_keeps_sinks_recent_and_the_best_scores():
    scores = np.zeros((1, 2, 10), np.float32)
    scores[0, 0] = [0, 5, 1, 9, 2, 8, 3, 7, 4, 6]
    scores[0, 1] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # 8 blocks hold the sequence (8, 9 are beyond it); keep 5: sink 0, recent 6 and 7, then
    # the two best among 1..5: head 0 -> 3 (9) and 5 (8); head 1 -> 5 (5) and 4 (4).
    kept, counts = _select_blocks(
        jnp.asarray(scores), jnp.asarray([8]), jnp.asarray([5]), CFG, max_kept=6
    )
    np.testing.assert_array_equal(np.asarray(counts), [[5, 5]])
    assert set(np.asarray(kept)[0, 0, :5]) == {0, 6, 7, 3, 5}
    assert set(np.asarray(kept)[0, 1, :5]) == {0, 6, 7, 5, 4}
    assert np.all(np.asarray(kept) < 8)


def test_recently_hot_blocks_rank_before_better_bounds():
    cfg = PruningConfig(enabled=True, sink_blocks=1, recent_blocks=1, mass_threshold=0.1)
    scores = jnp.asarray([[[0, 9, 8, 1, 2, 0]]], jnp.float32)
    mass = jnp.asarray([[[0.5, 0.0, 0.05, 0.3, 0.2, 0.1]]], jnp.float32)
    # Keep 4 of 6: sink 0 and recent 5 forced; then the hot blocks 3 and 4 (mass >= 0.1) rank
    # before 1 and 2 despite their lower bounds.
    kept, _ = _select_blocks(scores, jnp.asarray([6]), jnp.asarray([4]), cfg, 4, mass)
    assert set(np.asarray(kept)[0, 0]) == {0, 5, 3, 4}
    # Threshold 0: the step is compiled to rank by bounds alone (pruned attention passes no
    # mass), whatever mass the blocks drew.
    bounds_only = dataclasses.replace(cfg, mass_threshold=0.0)
    assert cfg.shape().ranks_by_mass and not bounds_only.shape().ranks_by_mass
    plain, _ = _select_blocks(scores, jnp.asarray([6]), jnp.asarray([4]), bounds_only, 4, None)
    assert set(np.asarray(plain)[0, 0]) == {0, 5, 1, 2}


def test_mass_memory_stores_real_observations_per_row_and_block():
    # Memory for 3 rows of 4 blocks, 2 KV heads; batch rows 0 and 1 are store rows 2 and 0.
    memory = jnp.zeros((3, 4, 2), jnp.float32)
    kept = jnp.asarray([[[3, 1, 3]], [[0, 2, 2]]], jnp.int32)  # shared by the 2 heads
    observed = jnp.asarray(
        [[[0.7, 0.3, 0.0], [0.6, 0.4, 0.0]], [[1.0, 0.0, 0.0], [0.9, 0.1, 0.0]]], jnp.float32
    )
    counts = jnp.asarray([[2], [2]], jnp.int32)
    rows = jnp.asarray([2, 0], jnp.int32)
    # Row 0's padding entry repeats block 3 with mass 0: it must not overwrite 0.7 / 0.6.
    # Batch row 1 is not a real step: nothing of it is stored.
    memory = _remember_mass(memory, rows, kept, observed, counts, jnp.asarray([True, False]))
    expected = np.zeros((3, 4, 2), np.float32)
    expected[2, 3], expected[2, 1] = [0.7, 0.6], [0.3, 0.4]
    np.testing.assert_array_equal(np.asarray(memory), expected)
    # Another store row reading the same blocks keeps its own memory.
    other = jnp.asarray([2, 1], jnp.int32)  # batch row 1 is now store row 1
    memory = _remember_mass(memory, other, kept, observed, counts, jnp.asarray([False, True]))
    expected[1, 0], expected[1, 2] = [1.0, 0.9], [0.0, 0.1]
    np.testing.assert_array_equal(np.asarray(memory), expected)


def test_a_new_sequence_in_a_row_remembers_no_mass():
    from etjax.cache.kv_cache import forget_row_mass, init_kv_cache
    from etjax.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=64,
    )
    cache = init_kv_cache(cfg, 4, 4, 3, 5)
    cache = cache.replace(block_mass=jnp.ones_like(cache.block_mass))
    mass = np.asarray(forget_row_mass(cache, np.int32(1)).block_mass)
    assert mass.shape == (2, 3, 5, 1)
    assert (mass[:, 1] == 0).all() and (mass[:, [0, 2]] == 1).all()


@pytest.mark.parametrize("shared", [True, False])
def test_page_scores_loop_only_to_the_longest_row_and_match_the_plain_bound(shared):
    # The engine passes page tables as wide as its longest possible sequence; scoring loops
    # over slices of SCORE_PAGES pages up to the batch's longest row. Every page a row holds
    # must get the plain bound (several trips, a last slice past the table's end).
    from pallas_kernels.page_scores.xla import SCORE_PAGES, score_pages_xla

    rng = np.random.default_rng(5)
    b, h, kvh, hd, n_pages, width = 3, 6, 3, 8, 200, 2 * SCORE_PAGES + 37
    k_min = jnp.asarray(rng.normal(size=(n_pages, kvh, hd)).astype(np.float32))
    k_max = k_min + jnp.asarray(rng.uniform(0, 2, size=k_min.shape).astype(np.float32))
    table = rng.integers(1, n_pages, size=(b, width)).astype(np.int32)
    num_blocks = np.array([5, 2 * SCORE_PAGES + 20, SCORE_PAGES], np.int32)
    q = jnp.asarray(rng.normal(size=(b, h, hd)).astype(np.float32))
    scores = score_pages_xla(q, k_min, k_max, jnp.asarray(table), jnp.asarray(num_blocks), shared)
    plain = np.asarray(_block_upper_bounds(q, k_min, k_max, table))
    if shared:
        plain = plain.max(1, keepdims=True)
    assert scores.shape == plain.shape
    reached = -(-num_blocks.max() // SCORE_PAGES) * SCORE_PAGES
    np.testing.assert_allclose(np.asarray(scores)[..., :reached], plain[..., :reached], rtol=1e-6)
    assert np.all(np.asarray(scores)[..., reached:] == -np.inf)  # never read


def _selections():
    chosen = {"xla": select_blocks}
    if jax.default_backend() == "cpu":
        from cpp_kernels import cpu_kernels_available
        from pallas_kernels.block_selection.cpu import select_blocks_cpu

        if cpu_kernels_available():
            chosen["cpu"] = functools.partial(select_blocks, kernel=select_blocks_cpu)
    return chosen


@pytest.mark.parametrize("backend", sorted(_selections()))
def test_grouped_rows_select_their_shared_prefix_together_and_their_own_pages_apart(backend):
    # Rows 0-2 share their first 6 pages (leader 0); row 3 is alone. Sink 1, recent 1,
    # floors of 2 blocks. Worked by hand:
    # - the group keeps ceil(max fraction 0.5 x 6) = 3 of the prefix: sink 0, its last page 5
    #   and the best of 1-4 by the largest bound over the three rows (column 3: 8, row 2's;
    #   row 0 alone would have taken column 2);
    # - each row keeps its fraction of its own pages after the prefix: row 0 ceil(0.3 x 4)
    #   -> 2 (their first, 6, and last, 9); row 1 ceil(0.5 x 6) = 3 (6, 11 and 8, its best);
    #   row 2 ceil(0.2 x 3) -> 2 (6, 8);
    # - row 3 alone: ceil(0.4 x 8) = 4 (0, 7, and its best two, 3 and 1).
    select = _selections()[backend]
    cfg = PruningConfig(enabled=True, sink_blocks=1, recent_blocks=1, min_blocks=2)
    scores = np.zeros((4, 1, 12), np.float32)
    scores[0, 0, :6] = [0, 1, 7, 2, 0, 0]
    scores[1, 0, :6] = [0, 3, 1, 2, 0, 0]
    scores[2, 0, :6] = [0, 0, 0, 8, 0, 0]
    scores[1, 0, 7:11] = [1, 9, 2, 3]
    scores[3, 0, :8] = [0, 5, 1, 6, 0, 2, 0, 0]
    groups = PrunedGroups(jnp.asarray([0, 0, 0, 3]), jnp.asarray([6, 6, 6, 0]))
    num_blocks = jnp.asarray([10, 12, 9, 8])
    fraction = jnp.asarray([0.3, 0.5, 0.2, 0.4], jnp.float32)
    kept, counts, shared = _select_grouped(
        select, jnp.asarray(scores), num_blocks, fraction, groups, cfg, 12
    )
    kept, counts = np.asarray(kept), np.asarray(counts)
    np.testing.assert_array_equal(counts[:, 0], [5, 6, 5, 4])
    assert np.asarray(shared)[0] == 3 and np.asarray(shared)[3] == 0
    for row, own in enumerate([{6, 9}, {6, 8, 11}, {6, 8}]):
        assert set(kept[row, 0, :3]) == {0, 3, 5}
        np.testing.assert_array_equal(kept[row, 0, :3], kept[0, 0, :3])  # the same order
        assert set(kept[row, 0, 3 : counts[row, 0]]) == own
    assert set(kept[3, 0, :4]) == {0, 1, 3, 7}
    assert np.all(kept < 12)
    attended, spared = _grouped_blocks(fraction, num_blocks, groups, cfg)
    np.testing.assert_array_equal(np.asarray(attended), [5, 6, 5, 4])
    np.testing.assert_allclose(np.asarray(spared), [2.0, 2.0, 2.0, 0.0])  # 3 x (1 - 1/3)

    # A block hot for one member (mass >= 0.1 when last read) is hot for the group: row 2's
    # column 4 ranks before column 3's better bound.
    hot = dataclasses.replace(cfg, mass_threshold=0.1)
    mass = np.zeros_like(scores)
    mass[2, 0, 4] = 0.5
    kept, _, _ = _select_grouped(
        select, jnp.asarray(scores), num_blocks, fraction, groups, hot, 12, jnp.asarray(mass)
    )
    assert set(np.asarray(kept)[1, 0, :3]) == {0, 4, 5}
