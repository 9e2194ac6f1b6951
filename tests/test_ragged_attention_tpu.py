"""The Pallas TPU pass of ragged paged attention (pallas_kernels/ragged_attention/pallas_tpu.py)
against the float32 reference, in interpret mode on this CPU; tests/test_tpu_compile.py builds
it for v5e and v6e with Mosaic.

The kernel runs in xla.py's place of its loops (`native_pass`), as the `pallas_tpu` attention
backend runs it: the batches are test_ragged_attention_gpu.py's (a decode pass and a pass of
prefill chunks, GQA, pages scattered through the pool). Tolerances as there: float32 differs
from the reference only by summation order; bfloat16 pages and queries are the same rounded
values on both sides, the output is rounded to bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_attention import pallas_tpu, ragged_attention_xla
from pallas_kernels.ragged_attention.pallas_tpu import ragged_pass_tpu
from pallas_kernels.ragged_attention.work_items import (
    Segment,
    SharedPrefix,
    build_pass,
    build_shared_pass,
)
from tests.kernel_references import ragged_attention_reference
from tests.test_ragged_attention_gpu import TOLERANCE, _case, _check

PASS = functools.partial(ragged_pass_tpu, interpret=True)
# As the engine runs it, inside one compiled program (chunk, softcap, shared_last and the pass
# static): called eagerly, each of its loops and operations compiles on its own.
_xla_jitted = jax.jit(ragged_attention_xla, static_argnums=(5, 7, 8, 9))

# A long decode row, a prefill chunk starting mid-page after a cached prefix, a short decode
# row, a chunk from position 0.
LENGTHS = [(40, 1), (13, 24), (5, 1), (0, 7)]


@pytest.mark.parametrize(
    "page_size, dtype, window, softcap, max_rows",
    [(4, jnp.float32, 9, 2.0, 8), (16, jnp.bfloat16, 0, 0.0, pallas_tpu.MAX_ROWS)],
    ids=["float32-window-softcap-row-blocks", "bfloat16"],
)
def test_tpu_pass_matches_the_reference(page_size, dtype, window, softcap, max_rows, monkeypatch):
    # With blocks of 8 rows, a prefill tile's 48 rows (16 tokens x 3 heads) run as six
    # programs, each reading the tile's pages.
    monkeypatch.setattr(pallas_tpu, "MAX_ROWS", max_rows)
    args, truth = _case(LENGTHS, page_size, 2, 3, dtype, 2, 7, window=window, softcap=softcap)
    ours = _xla_jitted(*args, 16, jnp.int32(window), softcap, False, PASS)
    assert ours.dtype == dtype
    _check(ours, truth, dtype, LENGTHS)


def test_tpu_pass_merges_a_shared_prefix_by_its_log_sum_exps():
    # Cascade attention: three decode rows hold the same first 8 pages; a shared pass reads
    # them once for the three, each row's own pass the pages after them, and the two are
    # merged token by token through the kernel's log-sum-exps: the reference's attention
    # over each row's whole table.
    rng = np.random.default_rng(5)
    ps, kvh, g, hd, shared = 4, 2, 3, 16, 8
    num_pages = 1 + shared + 3 * 4
    k_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, ps, hd)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(num_pages, kvh, ps, hd)), jnp.float32)
    prefix = list(range(1, 1 + shared))
    tables = [prefix + list(range(1 + shared + 4 * r, 1 + shared + 4 * r + 4)) for r in range(3)]
    positions = np.array([shared * ps + 5, shared * ps + 14, shared * ps + 1, -1], np.int32)
    rows = [
        Segment(r, 1, int(p), int(p), tables[r], skip_pages=shared)
        for r, p in enumerate(positions[:3])
    ]
    sizes = dict(page_size=ps, num_tokens=4, max_tiles=4, max_items=16)
    own = build_pass(rows, q_tile=1, kv_tile=2, **sizes)
    common = build_shared_pass([SharedPrefix([0, 1, 2], prefix)], q_tile=4, kv_tile=4, **sizes)
    q = jnp.asarray(rng.normal(size=(4, kvh * g, hd)), jnp.float32)
    ours = _xla_jitted(
        q, k_pages, v_pages, jnp.asarray(positions), (own, common), 16, 0, 0.0, True, PASS
    )
    table = jnp.asarray([*tables, tables[0]])
    token_seq = jnp.asarray([0, 1, 2, -1], jnp.int32)
    truth = np.asarray(
        ragged_attention_reference(q, k_pages, v_pages, jnp.asarray(positions), token_seq, table)
    )
    error = np.max(np.abs(np.asarray(ours) - truth))
    assert error <= TOLERANCE[jnp.float32] * np.max(np.abs(truth)), error
    assert np.all(np.asarray(ours)[3] == 0)
