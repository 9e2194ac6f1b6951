"""The CPU attention kernel (cpp_kernels/ragged_pass.cc) against the float32
reference: narrow (decode) and wide (prompt chunk) query tiles over ragged batches drawn by
hypothesis (bursts whose
items reach past the current position, windows, soft caps, float32, float16 and bfloat16
pools, head sizes on and off its 16-float lanes), its log-sum-exps against ones computed here
in NumPy, and the backend choice that puts it on the product path. Pruned decode's page bounds
(page_bounds.cc) against their definition; its block-sparse kernel (block_sparse.cc) runs in
tests/test_block_sparse_kernels.py with the other backends."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpp_kernels import cpu_kernels_available
from etjax.attention import resolve_backend
from etjax.pruning.config import PruningConfig
from pallas_kernels.block_selection.cpu import select_blocks_cpu
from pallas_kernels.block_selection.xla import select_blocks_xla
from pallas_kernels.page_scores.cpu import page_bounds_cpu
from pallas_kernels.page_scores.reference import block_upper_bounds
from pallas_kernels.ragged_attention import ragged_attention_xla
from pallas_kernels.ragged_attention.cpu import ragged_pass_cpu
from tests.hypothesis_profiles import examples
from tests.kernel_references import ragged_attention_reference
from tests.subprocess_env import subprocess_env
from tests.test_ragged_attention import MAX_CACHED, MAX_EXTRA, MAX_NEW, MAX_SEQS, _case

PAGE_SIZE, KV_HEADS, GROUP, KV_TILE = 4, 2, 3, 2
# The kernel as the engine runs it: every pass of `ragged_attention_xla`.
_with_kernel = jax.jit(
    lambda q, k, v, pos, tile_pass, window, softcap: ragged_attention_xla(
        q, k, v, pos, (tile_pass,), 8, window, softcap, native_pass=ragged_pass_cpu
    ),
    static_argnums=6,
)
_pass_alone = jax.jit(ragged_pass_cpu, static_argnums=6)
# The definitions the C++ scorer and selection are checked against, one program per shape
# (eagerly, each of their operations would compile on its own).
_block_upper_bounds = jax.jit(block_upper_bounds)
_select_blocks_xla = jax.jit(select_blocks_xla, static_argnums=6)  # max_kept


def _reference_lse(q, k_pages, v_pages, positions, token_seq, table, window, softcap):
    # log sum exp of each token's scaled (and capped) scores over the keys it sees, in NumPy.
    q, k_pages = np.asarray(q, np.float64), np.asarray(k_pages.astype(jnp.float32), np.float64)
    t, h, hd = q.shape
    lse = np.full((t, h), -np.inf)
    for token in np.flatnonzero(token_seq >= 0):
        pos = positions[token]
        keys = k_pages[table[token_seq[token]]].transpose(1, 0, 2, 3).reshape(KV_HEADS, -1, hd)
        seen = np.arange(keys.shape[1]) <= pos
        if window:
            seen &= np.arange(keys.shape[1]) > pos - window
        for head in range(h):
            scores = keys[head // GROUP][seen] @ q[token, head] * hd**-0.5
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            lse[token, head] = np.log(np.sum(np.exp(scores - scores.max()))) + scores.max()
    return lse


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    assert cpu_kernels_available(), "the CPU kernel did not build (is a C++ compiler installed?)"


@settings(max_examples=examples(30), deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(0, MAX_CACHED), st.integers(1, MAX_NEW)),
        min_size=1,
        max_size=MAX_SEQS,
    ),
    q_tile=st.sampled_from([1, 3, 8, 16, 32]),  # 32: a wide tile (wide_tiles.h)
    page_size=st.sampled_from([PAGE_SIZE, 16]),  # 16: whole pages scored 16 keys at a time
    dtype=st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16]),
    head_dim=st.sampled_from([32, 20]),  # lanes of 16, and 16 + a scalar tail
    window=st.sampled_from([0, 5, 19]),
    softcap=st.sampled_from([0.0, 2.0]),
    extra=st.integers(0, MAX_EXTRA),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_matches_the_reference(
    lengths, q_tile, page_size, dtype, head_dim, window, softcap, extra, seed
):
    case = _case(
        lengths, page_size, KV_HEADS, GROUP, head_dim, dtype, q_tile, KV_TILE, extra, seed, window
    )
    q, k_pages, v_pages, positions, token_seq, table, tile_pass = case
    q = q.astype(jnp.float32)
    positions = jnp.asarray(positions)
    ours = np.asarray(_with_kernel(q, k_pages, v_pages, positions, tile_pass, window, softcap))
    truth = np.asarray(
        ragged_attention_reference(
            q,
            k_pages,
            v_pages,
            positions,
            jnp.asarray(token_seq),
            jnp.asarray(table),
            window,
            softcap,
        )
    )
    # float32 throughout (pages rounded once, as the reference reads them): summation order.
    assert np.max(np.abs(ours - truth)) <= 2e-5 * np.abs(truth).max()
    assert np.all(ours[token_seq < 0] == 0)

    # The log-sum-exps a shared pass is merged by: each real token's in its tile slot.
    _, lse = _pass_alone(q, k_pages, v_pages, positions, tile_pass, jnp.int32(window), softcap)
    tokens = np.asarray(tile_pass.tile_tokens).reshape(-1)
    lse = np.asarray(lse).reshape(tokens.size, -1)
    expected = _reference_lse(
        q, k_pages, v_pages, np.asarray(positions), token_seq, table, window, softcap
    )
    real = tokens < len(token_seq)
    assert np.allclose(lse[real], expected[tokens[real]], rtol=1e-5, atol=1e-5)
    assert np.all(lse[~real] == -1e30)


@pytest.mark.parametrize(
    ("q_tile", "dtype", "window", "softcap"),
    [
        (32, jnp.float32, 0, 0.0),
        (64, jnp.float16, 0, 2.0),
        (32, jnp.bfloat16, 19, 0.0),
        (64, jnp.float32, 37, 0.0),
    ],
)
def test_wide_tiles_match_the_reference(q_tile, dtype, window, softcap):
    # Prompt chunks on the kernel's wide path (pages of 16, head_dim 32): a chunk from
    # position 0 (its own key tiles on the diagonal), chunks after 20 and 61 cached tokens (off
    # the page grid), a tile with 3 real tokens; 3 query heads a KV head: blocks of 96 rows and
    # of 24 (a 40-token chunk).
    lengths = [(20, 30), (0, 40), (61, 3), (7, 33)]
    case = _case(lengths, 16, KV_HEADS, GROUP, 32, dtype, q_tile, KV_TILE, 0, 11, window)
    q, k_pages, v_pages, positions, token_seq, table, tile_pass = case
    q = q.astype(jnp.float32)
    _, lse = _pass_alone(
        q, k_pages, v_pages, jnp.asarray(positions), tile_pass, jnp.int32(window), softcap
    )
    ours = np.asarray(
        _with_kernel(q, k_pages, v_pages, jnp.asarray(positions), tile_pass, window, softcap)
    )
    truth = np.asarray(
        ragged_attention_reference(
            q,
            k_pages,
            v_pages,
            jnp.asarray(positions),
            jnp.asarray(token_seq),
            jnp.asarray(table),
            window,
            softcap,
        )
    )
    assert np.max(np.abs(ours - truth)) <= 2e-5 * np.abs(truth).max()
    tokens = np.asarray(tile_pass.tile_tokens).reshape(-1)
    lse = np.asarray(lse).reshape(tokens.size, -1)
    real = tokens < len(token_seq)
    expected = _reference_lse(
        q, k_pages, v_pages, np.asarray(positions), token_seq, table, window, softcap
    )
    assert np.allclose(lse[real], expected[tokens[real]], rtol=1e-5, atol=1e-5)


def test_pages_outside_the_pool_are_never_read():
    # An item naming a page past the pool (a corrupt plan) must not read out of bounds: its
    # keys are skipped. A token at position 5 over two pages of 4; its second page replaced by
    # 10**6 leaves keys 0..3: the reference for a query at position 3.
    case = _case([(5, 1)], PAGE_SIZE, KV_HEADS, GROUP, 16, jnp.float32, 1, KV_TILE, 0, 3)
    q, k_pages, v_pages, positions, token_seq, table, tile_pass = case
    pages = np.asarray(tile_pass.item_pages).copy()
    pages[0, 1] = 10**6
    ours, _ = _pass_alone(
        q, k_pages, v_pages, jnp.asarray(positions), tile_pass._replace(item_pages=pages), 0, 0.0
    )
    positions_first = np.where(token_seq >= 0, 3, positions)
    truth = ragged_attention_reference(
        q,
        k_pages,
        v_pages,
        jnp.asarray(positions_first),
        jnp.asarray(token_seq),
        jnp.asarray(table),
    )
    assert np.allclose(np.asarray(ours)[0, 0], np.asarray(truth)[0], atol=1e-5)


def test_auto_picks_the_cpu_kernel_on_one_cpu_device_only():
    assert resolve_backend("auto", "cpu").name == "cpu"
    assert resolve_backend("auto", "cpu", devices=2).name == "xla"  # a mesh: the XLA loop
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        resolve_backend("cpu", "tpu")


@pytest.mark.parametrize("shared", [True, False])
def test_page_bounds_match_the_quest_bound_of_every_held_page(shared):
    # The C++ scorer against block_upper_bounds (the bound's plain definition) on rows holding
    # 1, 70 and 130 of 130 table columns (units of 64 pages split the long ones), -inf past them.
    rng = np.random.default_rng(5)
    rows, heads, kv_heads, head_dim, width = 3, 6, 2, 32, 130
    keys = rng.normal(size=(1 + rows * width, kv_heads, 4, head_dim)).astype(np.float32)
    k_min, k_max = jnp.asarray(keys.min(axis=2)), jnp.asarray(keys.max(axis=2))
    table = jnp.asarray((1 + rng.permutation(rows * width)).reshape(rows, width), jnp.int32)
    q = jnp.asarray(rng.normal(size=(rows, heads, head_dim)), jnp.float32)
    held = np.array([1, 70, 130])
    ours = np.asarray(page_bounds_cpu(q, k_min, k_max, table, jnp.asarray(held), shared))
    truth = np.asarray(_block_upper_bounds(q, k_min, k_max, table))  # [B, KVH, P]
    if shared:
        truth = truth.max(axis=1, keepdims=True)
    for row, count in enumerate(held):
        np.testing.assert_allclose(
            ours[row, :, :count], truth[row, :, :count], rtol=1e-5, atol=1e-5
        )
        assert np.all(ours[row, :, count:] == -np.inf)


def test_without_a_compiler_the_engine_falls_back_to_xla_with_a_warning(tmp_path):
    # A machine with no C++ compiler (an empty PATH, no CXX) and no library built yet: the
    # backend "auto" resolves to, and what the log says.
    env = subprocess_env() | {
        "PATH": str(tmp_path),
        "ETJAX_KERNEL_CACHE": str(tmp_path / "kernels"),
    }
    env.pop("CXX", None)
    script = (
        "import logging; logging.basicConfig(); "
        "from etjax.attention import resolve_backend; print(resolve_backend('auto', 'cpu').name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["xla"]
    assert "could not be built" in done.stderr and "no C++ compiler found" in done.stderr


@pytest.mark.parametrize("by_mass", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_block_selection_keeps_what_the_xla_selection_keeps(by_mass, shared):
    # The C++ selection against the XLA one (the rule's definition): rows shorter than the
    # table, budgets under and over what a row holds, hot blocks by mass, a kept table narrower
    # and wider than the page table. With distinct scores the kept sets are the same; with
    # many ties (scores rounded to 0.5) any choice among equals at the cut keeps the same
    # ranked values (XLA's full sort does not keep top_k's lower-index-first order there).
    rng = np.random.default_rng(11)
    rows, width = 6, 40
    heads = 1 if shared else 3
    cfg = PruningConfig(enabled=True, sink_blocks=1, recent_blocks=2, mass_threshold=0.2)
    thresholds = cfg.thresholds()  # the traced scalars a step passes
    settings = (thresholds.sink_blocks, thresholds.recent_blocks, thresholds.mass_threshold)
    num_blocks = jnp.asarray([40, 1, 17, 3, 30, 40], jnp.int32)
    budget = jnp.asarray([5, 4, 30, 1, 12, 40], jnp.int32)
    mass = jnp.asarray(rng.uniform(0, 0.3, size=(rows, heads, width)), jnp.float32)
    mass = mass if by_mass else None
    raw = rng.normal(size=(rows, heads, width))
    for scores, ties in ((raw, False), (np.round(raw * 2) / 2, True)):
        scores = jnp.asarray(scores, jnp.float32)
        # The values the rule ranks by (forced blocks first, then hot ones, then the scores).
        block = np.arange(width)
        n = np.asarray(num_blocks)[:, None, None]
        hot = np.asarray(scores) + (1e6 * (np.asarray(mass) >= 0.2) if by_mass else 0)
        forced = (block < 1) | ((block >= n - 2) & (block < n))
        ranked = np.where(forced, np.inf, np.where(block < n, hot, -np.inf))
        for max_kept in (12, 48):
            args = (scores, num_blocks, budget, *settings, max_kept, mass)
            want, want_counts = _select_blocks_xla(*args)
            got, counts = select_blocks_cpu(*args)
            np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
            for r, h in np.ndindex(rows, heads):
                count = int(counts[r, h])
                ours, theirs = np.asarray(got[r, h]), np.asarray(want[r, h])
                assert np.all(ours[count:] == ours[0])  # padding repeats a kept block
                if ties:
                    values = lambda kept: sorted(ranked[r, h, kept[:count]])  # noqa: B023, E731
                    assert values(ours) == values(theirs)
                else:
                    assert sorted(ours[:count]) == sorted(theirs[:count])
