"""The Pallas GPU (Triton) backend of ragged paged attention against the float32 reference.

On a GPU (benchmarks/gpu_check.sh) the kernel runs compiled; elsewhere in interpret mode.
Batches are drawn by hypothesis and split into two passes the way etjax/attention/plan.py routes
them: one-token (decode) segments into a pass of one-token query tiles, longer ones (prefill
chunks after a cached prefix, starting mid-page, crossing pages) into a pass of wide tiles.
Tiles are smaller than the engine's (16 x 4 pages, not 64 x 4) to keep interpret mode fast.

Tolerances, relative to max |out|: float32 differs from the reference only by summation order.
bfloat16 q and pages are the same rounded values on both sides, and scores accumulate in
float32, but the output is rounded to bfloat16 (2^-9 relative) and, where the kernel uses a dot
(16+ rows), its weights are rounded to bfloat16 before multiplying the values, as flash
attention does; 1e-2 bounds both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_attention import Segment, build_pass
from pallas_kernels.ragged_attention.pallas_gpu import ragged_attention_gpu
from pallas_kernels.ragged_attention.work_items import items_capacity
from tests.hypothesis_profiles import examples
from tests.kernel_references import ragged_attention_reference

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}
INTERPRET = jax.default_backend() != "gpu"  # compiled on a GPU only; interpreted elsewhere
HEAD_DIM = 16
DECODE_TILES = (1, 2)  # (q_tile, kv_tile): the engine uses (1, 4)
PREFILL_TILES = (16, 4)  # the engine uses (64, 4)
# Shapes are padded to these bounds so that each drawn configuration compiles once.
MAX_SEQS, MAX_CACHED, MAX_NEW, MAX_EXTRA = 4, 40, 24, 3


def _case(lengths, page_size, kvh, groups, dtype, extra, seed, window=0, softcap=0.0):
    # lengths: (cached, new) per sequence. Returns the kernel's and the reference's inputs.
    rng = np.random.default_rng(seed)
    width = -(-(MAX_CACHED + MAX_NEW + MAX_EXTRA) // page_size)
    num_pages = MAX_SEQS * width + 1
    order = rng.permutation(np.arange(1, num_pages))  # pages scattered through the pool
    shape = (num_pages, kvh, page_size, HEAD_DIM)
    k_pages = jnp.asarray(rng.normal(size=shape), dtype)
    v_pages = jnp.asarray(rng.normal(size=shape), dtype)
    num_tokens = MAX_SEQS * MAX_NEW + 2  # trailing padding tokens
    q = jnp.asarray(rng.normal(size=(num_tokens, kvh * groups, HEAD_DIM)) * 2.0, dtype)
    positions = np.full(num_tokens, -1, np.int32)
    token_seq = np.full(num_tokens, -1, np.int32)
    table = np.zeros((MAX_SEQS, width), np.int32)
    decode, prefill, start = [], [], 0
    for s, (cached, new) in enumerate(lengths):
        reach = cached + new - 1 + (extra if new == 1 else 0)  # decode bursts reach further
        pages = order[s * width : s * width + reach // page_size + 1].tolist()
        table[s, : len(pages)] = pages
        positions[start : start + new] = cached + np.arange(new)
        token_seq[start : start + new] = s
        (decode if new == 1 else prefill).append(Segment(start, new, cached, reach, pages))
        start += new
    passes = []
    for segments, (q_tile, kv_tile) in ((decode, DECODE_TILES), (prefill, PREFILL_TILES)):
        max_tiles = MAX_SEQS * -(-MAX_NEW // q_tile)
        tile_pass = build_pass(
            segments,
            page_size=page_size,
            q_tile=q_tile,
            kv_tile=kv_tile,
            num_tokens=num_tokens,
            max_tiles=max_tiles,
            max_items=items_capacity(max_tiles * (width // kv_tile + 1), 16),
            window=window,
        )
        passes.append(tile_pass)
    truth = ragged_attention_reference(
        q,
        k_pages,
        v_pages,
        jnp.asarray(positions),
        jnp.asarray(token_seq),
        jnp.asarray(table),
        window,
        softcap,
    )
    return (q, k_pages, v_pages, jnp.asarray(positions), tuple(passes)), np.asarray(truth)


# (page size, (KV heads, query heads per KV head), dtype, KV splits): every pair of values of
# any two fields occurs (a covering array: five programs where every combination would be
# sixteen); the batches drawn vary within each.
SHAPES = [
    (4, (1, 1), jnp.float32, 1),
    (4, (2, 3), jnp.bfloat16, 3),
    (16, (1, 1), jnp.bfloat16, 3),
    (16, (2, 3), jnp.float32, 3),
    (16, (2, 3), jnp.bfloat16, 1),
]


def _check(ours, truth, dtype, lengths):
    ours = np.asarray(ours, np.float32)
    error = np.max(np.abs(ours - truth))
    assert error <= TOLERANCE[dtype] * np.max(np.abs(truth)), error
    assert np.all(ours[sum(new for _, new in lengths) :] == 0)  # padding tokens


@settings(max_examples=examples(12))
@given(
    lengths=st.lists(
        st.tuples(st.integers(0, MAX_CACHED), st.sampled_from([1, 1, 2, 7, 16, MAX_NEW])),
        min_size=1,
        max_size=MAX_SEQS,
    ),
    shape=st.sampled_from(SHAPES),
    extra=st.integers(0, MAX_EXTRA),
    seed=st.integers(0, 2**16),
)
def test_gpu_kernel_matches_the_reference_on_any_ragged_batch(lengths, shape, extra, seed):
    page_size, heads, dtype, num_splits = shape
    args, truth = _case(lengths, page_size, *heads, dtype, extra, seed)
    ours = ragged_attention_gpu(*args, interpret=INTERPRET, num_splits=num_splits)
    assert ours.dtype == dtype
    _check(ours, truth, dtype, lengths)


@pytest.mark.parametrize(
    "page_size, dtype", [(4, jnp.float32), (16, jnp.float32), (16, jnp.bfloat16)]
)
def test_gpu_kernel_mixed_batch_with_default_splits(page_size, dtype):
    # GQA (3 query heads per KV head), both passes: a long decode row, a short one, a prefill
    # chunk starting mid-page after a cached prefix and one from position 0; the default split
    # count (many programs share each tile's items, most of them empty for the short tiles).
    lengths = [(MAX_CACHED, 1), (13, MAX_NEW), (5, 1), (0, 7)]
    args, truth = _case(lengths, page_size, 2, 3, dtype, 2, seed=7)
    _check(ragged_attention_gpu(*args, interpret=INTERPRET), truth, dtype, lengths)


@pytest.mark.parametrize("window", [3, 9, 26])
def test_gpu_kernel_sliding_window(window):
    # The mixed batch under a sliding window (a traced scalar, as the engine passes it): long
    # decode rows and chunks see only their last `window` positions, from pages the plan
    # starts at the window.
    lengths = [(MAX_CACHED, 1), (13, MAX_NEW), (5, 1), (0, 7)]
    args, truth = _case(lengths, 4, 2, 3, jnp.float32, 2, seed=8, window=window)
    ours = ragged_attention_gpu(*args, interpret=INTERPRET, window=jnp.int32(window))
    _check(ours, truth, jnp.float32, lengths)


def test_gpu_kernel_soft_caps_scores():
    # Gemma 2's cap on attention scores, with a window, against the reference's.
    lengths = [(MAX_CACHED, 1), (13, MAX_NEW), (5, 1), (0, 7)]
    args, truth = _case(lengths, 4, 2, 3, jnp.float32, 2, seed=9, window=9, softcap=2.0)
    ours = ragged_attention_gpu(*args, interpret=INTERPRET, window=jnp.int32(9), softcap=2.0)
    _check(ours, truth, jnp.float32, lengths)


@pytest.mark.parametrize(
    "q_tile, dtype", [(1, jnp.bfloat16), (8, jnp.float32), (64, jnp.bfloat16), (64, jnp.float32)]
)
def test_gpu_kernel_lowers_to_triton_at_smollm2_shapes(q_tile, dtype):
    # Compiled mode cannot run without a GPU, but lowering to Triton IR can: it rejects loads
    # and stores whose sizes are not powers of two and primitives Triton lacks. SmolLM2's
    # attention (9 heads, 3 KV heads, head_dim 64, pages of 16): decode tiles of one token (3
    # rows, the broadcast path), speculation's verification tiles of 8 (a token and 7 drafts:
    # 24 rows in a 32-row block) and prefill tiles of 64 (three 64-row blocks, the dot path).
    pages = list(range(1, 41))
    tile_pass = build_pass(
        [Segment(0, q_tile, 500, 500 + q_tile - 1, pages)],
        page_size=16,
        q_tile=q_tile,
        kv_tile=4,
        num_tokens=64,
        max_tiles=1,
        max_items=16,
    )
    q = jnp.zeros((64, 9, 64), dtype)
    k_pages = jnp.zeros((41, 3, 16, 64), dtype)
    kernel = jax.jit(functools.partial(ragged_attention_gpu, interpret=False, num_splits=2))
    lowered = kernel.trace(q, k_pages, k_pages, jnp.zeros(64, jnp.int32), (tile_pass,)).lower(
        lowering_platforms=("cuda",)
    )
    assert "triton" in lowered.as_text()
