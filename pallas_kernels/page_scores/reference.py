"""The Quest bound of every page of a page table, plainly (the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_upper_bounds(
    q: jax.Array, k_min: jax.Array, k_max: jax.Array, page_table: jax.Array
) -> jax.Array:
    """Upper bound of the (scaled) attention logit per block and KV head: [B, KVH, P].

    q: [B, H, hd] queries (RoPE applied, unscaled); k_min, k_max: [N, KVH, hd];
    page_table: [B, P].
    """
    b, h, hd = q.shape
    kvh = k_min.shape[1]
    qg = q.reshape(b, kvh, h // kvh, 1, hd).astype(jnp.float32)
    lo = k_min[page_table].transpose(0, 2, 1, 3)[:, :, None]  # [B, KVH, 1, P, hd]
    hi = k_max[page_table].transpose(0, 2, 1, 3)[:, :, None]
    bound = jnp.sum(jnp.maximum(qg * lo, qg * hi), axis=-1)  # [B, KVH, G, P]
    return jnp.max(bound, axis=2) * hd**-0.5
