"""Block-sparse decode attention on the CPU kernel (pallas_kernels/cpu/block_sparse.cc, an XLA
FFI call): each (row, KV head) reads its kept pages where they lie. The `cpu` attention
backend's pruned steps (etjax/attention/backend.py); same signature and results as the other
backends (the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sparse.validation import check_inputs
from pallas_kernels.cpu.build import cpu_kernels_available

TARGET = "etjax_block_sparse_cpu"


def block_sparse_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    if not cpu_kernels_available():
        raise RuntimeError("the CPU attention kernels are not built (see the log's warning)")
    b, h, hd = q.shape
    kvh = k_pages.shape[1]
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((b, h, hd), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, kept_blocks.shape[-1]), jnp.float32),
        ),
    )
    as_int = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    out, mass = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        as_int(page_table),
        as_int(kept_blocks),
        as_int(kept_counts),
        as_int(lengths),
        scale=np.float32(hd**-0.5),
    )
    return out.astype(q.dtype), mass
