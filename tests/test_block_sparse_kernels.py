"""Block-sparse paged decode attention: every backend against the float32 reference.

On CPU the Pallas kernels run in interpret mode; on a GPU the Triton kernel runs compiled and on
a TPU the Mosaic kernel does (benchmarks/gpu_check.sh runs this file there).
Tolerances (max abs error of the output, whose entries are averages of unit-scale values):
float32 — different summation orders only, ~1e-6; bfloat16 — inputs are the same bfloat16 values
on both sides and accumulation is float32, so the difference is the final rounding of the output
to bfloat16 (2^-8 relative) plus order effects.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.attention import attend, padded_batch_plan
from pallas_kernels.block_sparse import (
    block_sparse_attention_reference,
    block_sparse_attention_xla,
)
from pallas_kernels.block_sparse.cpu import block_sparse_attention_cpu
from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu
from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu
from tests.hypothesis_profiles import examples

TOLERANCE = {"float32": dict(out=2e-5, mass=1e-5), "bfloat16": dict(out=2e-2, mass=1e-5)}
# The float32 reference, one program per shape: called eagerly, each of its operations would
# compile on its own for every shape (some 500 programs in this file).
reference = jax.jit(block_sparse_attention_reference)
_PLATFORM = jax.default_backend()
BACKENDS = {"xla": jax.jit(block_sparse_attention_xla)}
if _PLATFORM == "cpu":  # the C++ kernel, cpp_kernels/block_sparse.cc
    BACKENDS["cpu"] = jax.jit(block_sparse_attention_cpu)
if _PLATFORM in ("cpu", "tpu"):
    BACKENDS["pallas_tpu"] = functools.partial(
        block_sparse_attention_tpu, interpret=_PLATFORM == "cpu"
    )
if _PLATFORM in ("cpu", "gpu"):
    BACKENDS["pallas_gpu"] = functools.partial(
        block_sparse_attention_gpu, interpret=_PLATFORM == "cpu"
    )


# Shapes (rows, KV heads, query heads per KV head, head_dim, page size, page-table columns,
# kept-table width): each new shape compiles the kernel again (in interpret mode a large
# program), so the examples draw among a few that span the cases (one row, one column and one
# kept block; grouped queries; a kept table narrower than the page table; several KV heads)
# and vary everything else as data: lengths, pages, kept blocks and counts, values.
SHAPES = [
    (1, 1, 1, 16, 8, 1, 1),
    (3, 2, 3, 64, 16, 6, 4),
    (2, 4, 2, 16, 8, 5, 5),
]


@st.composite
def problems(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    b, kvh, group, hd, ps, width, num_kept = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    num_pages = 1 + b * width
    lengths = rng.integers(1, width * ps + 1, size=b)  # rarely a multiple of the page size
    used = -(-lengths // ps)  # blocks holding at least one position
    kept = np.zeros((b, kvh, num_kept), np.int32)
    counts = np.zeros((b, kvh), np.int32)
    for i in range(b):
        for h in range(kvh):
            count = int(rng.integers(1, min(num_kept, used[i]) + 1))  # from one page to all
            chosen = rng.permutation(used[i])[:count]
            kept[i, h, :count] = chosen
            counts[i, h] = count
    table = (1 + rng.permutation(b * width)).reshape(b, width).astype(np.int32)
    # Host arrays (bfloat16 through ml_dtypes): an eager conversion on the device would
    # compile a program for each shape and dtype.
    cast = lambda x: np.asarray(x, jnp.dtype(dtype))  # noqa: E731
    return dict(
        q=cast(rng.normal(size=(b, kvh * group, hd))),
        k_pages=cast(rng.normal(size=(num_pages, kvh, ps, hd))),
        v_pages=cast(rng.normal(size=(num_pages, kvh, ps, hd))),
        page_table=table,
        kept_blocks=kept,
        kept_counts=counts,
        lengths=lengths.astype(np.int32),
    ), dtype


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@settings(max_examples=examples(12), deadline=None)
@given(case=problems())
def test_backend_matches_reference(backend, case):
    args, dtype = case
    out, mass = BACKENDS[backend](**args)
    ref_out, ref_mass = reference(**args)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=tol["out"], rtol=0
    )
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=tol["mass"], rtol=0)
    counts = np.asarray(args["kept_counts"])
    np.testing.assert_allclose(np.asarray(mass).sum(-1), 1.0, atol=1e-5)  # a distribution
    kept = np.arange(mass.shape[-1])[None, None, :] < counts[..., None]
    assert np.all(np.asarray(mass)[~kept] == 0)


def test_reference_against_float64_numpy():
    rng = np.random.default_rng(1)
    b, kvh, group, hd, ps, width = 2, 2, 3, 16, 8, 4
    q = rng.normal(size=(b, kvh * group, hd))
    kp = rng.normal(size=(1 + b * width, kvh, ps, hd))
    vp = rng.normal(size=(1 + b * width, kvh, ps, hd))
    table = (1 + np.arange(b * width)).reshape(b, width)
    lengths = np.array([27, 9])
    kept = np.array([[[0, 3, 1], [2, 0, 3]], [[1, 0, 0], [0, 1, 0]]])
    counts = np.array([[3, 2], [2, 1]])
    out, _ = reference(
        *(jnp.asarray(x, jnp.float32) for x in (q, kp, vp)),
        *(jnp.asarray(x, jnp.int32) for x in (table, kept, counts, lengths)),
    )
    for i in range(b):
        for h in range(kvh):
            blocks = kept[i, h, : counts[i, h]]
            pos = np.concatenate([blk * ps + np.arange(ps) for blk in blocks])
            keys = np.concatenate([kp[table[i, blk], h] for blk in blocks])
            vals = np.concatenate([vp[table[i, blk], h] for blk in blocks])
            live = pos < lengths[i]
            for g in range(group):
                s = keys[live] @ q[i, h * group + g] / np.sqrt(hd)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[i, h * group + g], p @ vals[live], atol=1e-5)


def test_dense_is_sparse_with_every_block_and_equals_paged_attention():
    rng = np.random.default_rng(2)
    b, kvh, group, hd, ps, width = 3, 2, 2, 32, 8, 5
    q = jnp.asarray(rng.normal(size=(b, kvh * group, hd)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32)
    table = jnp.asarray((1 + np.arange(b * width)).reshape(b, width), jnp.int32)
    lengths = jnp.asarray([40, 17, 1], jnp.int32)
    all_blocks = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, kvh, width))
    counts = jnp.broadcast_to(-(-lengths // ps)[:, None], (b, kvh)).astype(jnp.int32)
    sparse, _ = BACKENDS["xla"](q, kp, vp, table, all_blocks, counts, lengths)
    # The model's own decode path (a different implementation) attends the same keys.
    plan, _ = padded_batch_plan(np.asarray(table), np.asarray(lengths) - 1, np.ones(b), 1, ps)
    paged = jax.jit(attend)(q, kp, vp, lengths - 1, plan)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(paged), atol=2e-6)


def test_tpu_kernel_reads_float16_pages_exactly():
    # Mosaic takes no float16 operand, so the TPU kernel reads float16 pages as 32-bit words of
    # two rows and widens them by hand (pallas_kernels/block_sparse/pallas_tpu.py): against the
    # reference over the same values in float32 (the widening is exact), with each row's last
    # position odd or even, a zero, a subnormal and a value at float16's largest exponent.
    rng = np.random.default_rng(3)
    b, kvh, group, hd, ps, width = 3, 2, 2, 16, 8, 3
    pages = rng.normal(size=(2, 1 + b * width, kvh, ps, hd)).astype(np.float16)
    pages[1, 1, 0, 0, :3] = [0.0, np.float16(6e-8), np.float16(-3e4)]  # values
    k16, v16 = jnp.asarray(pages[0]), jnp.asarray(pages[1])
    q = jnp.asarray(rng.normal(size=(b, kvh * group, hd)), jnp.float32)
    table = jnp.asarray((1 + np.arange(b * width)).reshape(b, width), jnp.int32)
    kept = jnp.asarray(np.tile([[[2, 0, 1]]], (b, kvh, 1)), jnp.int32)
    counts = jnp.asarray([[3, 2], [1, 3], [2, 2]], jnp.int32)
    lengths = jnp.asarray([23, 24, 17], jnp.int32)
    args = (q, k16, v16, table, kept, counts, lengths)
    out, mass = block_sparse_attention_tpu(*args, interpret=True)
    f32 = (q, k16.astype(jnp.float32), v16.astype(jnp.float32), *args[3:])
    ref_out, ref_mass = reference(*f32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=1e-5, rtol=0)


def test_bad_shapes_are_named():
    q = jnp.zeros((2, 4, 16))
    kp = jnp.zeros((5, 2, 8, 16))
    with pytest.raises(ValueError, match="kept_counts"):
        block_sparse_attention_xla(
            q,
            kp,
            kp,
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((2, 2, 1), jnp.int32),
            jnp.zeros((2,), jnp.int32),
            jnp.zeros((2,), jnp.int32),
        )
    with pytest.raises(ValueError, match="multiple of kv heads"):
        block_sparse_attention_reference(
            jnp.zeros((2, 3, 16)),
            kp,
            kp,
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((2, 2, 1), jnp.int32),
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((2,), jnp.int32),
        )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_selection_shared_by_kv_heads_equals_it_repeated_per_head(backend):
    rng = np.random.default_rng(3)
    b, kvh, group, hd, ps, width = 2, 3, 3, 16, 8, 6
    q = jnp.asarray(rng.normal(size=(b, kvh * group, hd)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32)
    table = jnp.asarray((1 + rng.permutation(b * width)).reshape(b, width), jnp.int32)
    lengths = jnp.asarray([45, 30], jnp.int32)
    shared = jnp.asarray([[[5, 0, 2, 2]], [[3, 1, 1, 1]]], jnp.int32)
    counts = jnp.asarray([[3], [2]], jnp.int32)
    out, mass = BACKENDS[backend](q, kp, vp, table, shared, counts, lengths)
    repeated = (jnp.repeat(shared, kvh, axis=1), jnp.repeat(counts, kvh, axis=1))
    ref_out, ref_mass = reference(q, kp, vp, table, *repeated, lengths)
    assert mass.shape == (b, kvh, 4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_xla_loop_over_a_wide_padded_table_matches_the_reference(shared):
    # 19 kept columns: three trips of LOOP_BLOCKS = 8 with the last one padded; rows keep 1, 8,
    # 9 and 19 blocks, so trips end inside a row's list, on its boundary and past it, and the
    # padding past each count (valid ids, as the selection leaves them) must read as nothing.
    rng = np.random.default_rng(7)
    b, kvh, group, hd, ps, width = 4, 2, 3, 16, 8, 24
    heads = 1 if shared else kvh
    lengths = np.array([width * ps, width * ps - 5, 10 * ps + 3, width * ps], np.int32)
    counts = np.broadcast_to(np.array([1, 8, 9, 19], np.int32)[:, None], (b, heads))
    kept = np.zeros((b, heads, 19), np.int32)
    for i in range(b):
        used = -(-int(lengths[i]) // ps)
        for h in range(heads):
            chosen = rng.permutation(used)[: counts[i, h]]
            kept[i, h] = np.concatenate([chosen, np.full(19 - len(chosen), chosen[0])])
    args = dict(
        q=jnp.asarray(rng.normal(size=(b, kvh * group, hd)), jnp.float32),
        k_pages=jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32),
        v_pages=jnp.asarray(rng.normal(size=(1 + b * width, kvh, ps, hd)), jnp.float32),
        page_table=jnp.asarray((1 + rng.permutation(b * width)).reshape(b, width), jnp.int32),
        kept_blocks=jnp.asarray(kept),
        kept_counts=jnp.asarray(np.ascontiguousarray(counts)),
        lengths=jnp.asarray(lengths),
    )
    out, mass = BACKENDS["xla"](**args)
    ref_out, ref_mass = reference(**args)
    tol = TOLERANCE["float32"]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=tol["out"], rtol=0)
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=tol["mass"], rtol=0)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ kernel runs on a CPU host")
@pytest.mark.parametrize("selections,dtype", [(1, "float32"), (2, "bfloat16")])
def test_grouped_rows_read_their_shared_pages_once_and_equal_the_reference(selections, dtype):
    # Rows 0, 2, 3 share their first 5 pages (the same pool pages, as the prefix cache gives
    # them), rows 1 and 4 their first 3; row 5 names a leader that leads another row, so it
    # runs alone. Each row of a group keeps the same shared columns first, then its own.
    rng = np.random.default_rng(7)
    b, kvh, group, hd, ps, width = 6, 2, 3, 16, 8, 9
    leaders = np.array([0, 1, 0, 0, 1, 2], np.int32)
    shared_pages = {0: 5, 1: 3}
    table = (1 + rng.permutation(b * width)).reshape(b, width).astype(np.int32)
    for row, leader in enumerate(leaders[:5]):
        table[row, : shared_pages[leader]] = table[leader, : shared_pages[leader]]
    lengths = np.array([70, 40, 55, 72, 33, 20], np.int32)
    kept = np.zeros((b, selections, width), np.int32)
    counts = np.zeros((b, selections), np.int32)
    shared_counts = np.zeros(b, np.int32)
    for leader, pages in shared_pages.items():
        shared_counts[leader] = pages - 1
    common = {
        (leader, s): rng.permutation(pages)[: pages - 1]
        for leader, pages in shared_pages.items()
        for s in range(selections)
    }
    for row in range(b):
        for s in range(selections):
            leader = int(leaders[row]) if row < 5 else row
            start = shared_pages[leader] if row < 5 else 0
            first = list(common[leader, s]) if row < 5 else []
            own = list(rng.permutation(np.arange(start, -(-lengths[row] // ps))))[:3]
            chosen = first + own
            kept[row, s, : len(chosen)] = chosen
            counts[row, s] = len(chosen)
    cast = lambda x: jnp.asarray(x, jnp.dtype(dtype))  # noqa: E731
    args = dict(
        q=cast(rng.normal(size=(b, kvh * group, hd))),
        k_pages=cast(rng.normal(size=(1 + b * width, kvh, ps, hd))),
        v_pages=cast(rng.normal(size=(1 + b * width, kvh, ps, hd))),
        page_table=jnp.asarray(table),
        kept_blocks=jnp.asarray(kept),
        kept_counts=jnp.asarray(counts),
        lengths=jnp.asarray(lengths),
    )
    out, mass = BACKENDS["cpu"](
        **args, leaders=jnp.asarray(leaders), shared_counts=jnp.asarray(shared_counts)
    )
    ref_out, ref_mass = reference(**args)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=tol["out"], rtol=0
    )
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=tol["mass"], rtol=0)
