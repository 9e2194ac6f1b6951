"""Routed experts (a mixture-of-experts MLP): each token runs through the k experts its router
ranks highest, and through no other.

The T tokens' T*k (token, expert) pairs are sorted by expert, so that each expert's rows are
contiguous, and the experts' SwiGLU runs as two grouped matrix products over those rows
(`products.grouped_product`: rows [T*k, D] against the stacked experts [E, 2M, D], with the
number of rows of each expert); each row's output is scaled by its routing weight and added
back to its token. The shapes are static whatever the routing: always T*k rows, so one
compiled step serves every batch of T tokens.

What the grouped product costs depends on where it runs (etjax/model/products.py). Elsewhere
it is `jax.lax.ragged_dot_general`: on TPU and GPU JAX lowers it to XLA's ragged dot (TPU's
grouped-matmul kernels), which multiplies each row by its own expert only, T*k rows' worth of
products. XLA:CPU has no such instruction in JAX 0.10.2: JAX's default lowering
(`_ragged_dot_general_impl` in jax/_src/lax/lax.py) expands the rows to every expert, masks
the rows of other experts to zero and runs a dense product: each of the T*k rows meets every
expert, E times the routed FLOPs, which a mesh of CPU devices still runs. The engine's step
programs on one CPU device run the C++ grouped-products kernel instead
(cpp_kernels/grouped_products.cc), which reads only the experts that have rows and
runs each row against its own: the routed FLOPs. The results are
the same; the cost model (etjax/entropy/cost.py) counts the routed experts.

A token may run fewer experts than k (`active_k`: entropy-steered experts, etjax/experts): it
keeps its first active_k of the k it ranks highest, their weights rescaled to the mass the k
carried. Its dropped pairs belong to no expert's group: they sort after every group, the group
sizes count kept pairs only, so the grouped products are given sum(active_k) rows, not T*k,
and their outputs are never added back. (The shapes stay T*k rows: the rows past the last
group are what a lowering that computes by group skips, the CPU kernel included; JAX's dense
CPU lowering multiplies them by zero like every row outside a group.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.layers import linear
from etjax.model.products import grouped_product


def route(
    x: jax.Array,
    router: jax.Array,
    top_k: int,
    normalize: bool,
    active_k: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The experts each token runs and their weights.

    Args:
      x: [T, D] the normed hidden states.
      router: [E, D] the router's projection.
      top_k: experts per token (k).
      normalize: renormalise the k weights to sum to 1 (Qwen3-MoE's `norm_topk_prob`;
        Mixtral's softmax over its top-k logits is the same).
      active_k: [T] int32 in 1..k, the experts each token runs (None: k each). A token keeps
        its first active_k and its other weights are 0; the kept weights are rescaled to carry
        what all k did (1 with `normalize`, their softmax mass without).

    Returns:
      weights [T, k] float32 (the softmax probabilities over all E experts of the k chosen,
      largest first) and experts [T, k] int32.
    """
    probs = jax.nn.softmax(linear(x, router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if active_k is not None:
        kept = jnp.arange(top_k) < active_k[:, None]
        kept_weights = jnp.where(kept, weights, 0.0)
        scale = (1.0 if normalize else total) / jnp.sum(kept_weights, axis=-1, keepdims=True)
        return kept_weights * scale, experts.astype(jnp.int32)
    if normalize:
        weights = weights / total
    return weights, experts.astype(jnp.int32)


def routed_experts(
    x: jax.Array,
    router: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    top_k: int,
    normalize: bool,
    active_k: jax.Array | None = None,
) -> jax.Array:
    """The mixture-of-experts MLP of x [T, D] -> [T, D]: the sum over each token's top-k
    experts (`route`) of weight * down(silu(gate(x)) * up(x)).

    Args:
      router: [E, D]; w_gate_up: [E, 2M, D], rows gate | up of each expert; w_down: [E, D, M]
        (either float, or kept in blocks: a stacked `QuantizedWeight`, etjax/model/quantized.py).
      active_k: [T] int32 in 1..k, the experts each token runs (None: k each); the others
        are given to no expert (see the module docstring).
    """
    t = x.shape[0]
    weights, experts = route(x, router, top_k, normalize, active_k)
    order, token, sizes = expert_groups(experts, w_gate_up.shape[0], active_k)
    rows = x.at[token].get(mode="fill", fill_value=0)
    gate, up = jnp.split(grouped_product(rows, w_gate_up, sizes), 2, axis=-1)
    out = grouped_product(jax.nn.silu(gate) * up, w_down, sizes)  # [T*k, D]
    scaled = (out.astype(jnp.float32) * weights.reshape(t * top_k)[order, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(scaled, mode="drop")


def expert_groups(
    experts: jax.Array, num_experts: int, active_k: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rows of the grouped products: the (token, expert) pairs sorted by expert.

    Args:
      experts: [T, k] int32 each token's experts, largest weight first (`route`).
      active_k: [T] int32 the first experts of each token that run (None: all k).

    Returns:
      order [T*k] int32, the flat pair (t * k + j) of each row; token [T*k] int32, the token
      of each row, T (out of range) for a dropped pair; sizes [E] int32, each expert's rows,
      which count kept pairs only (dropped pairs sort after every group).
    """
    t, top_k = experts.shape
    flat = experts.reshape(t * top_k)
    token = jnp.arange(t * top_k, dtype=jnp.int32) // top_k
    if active_k is not None:
        # A dropped pair's expert is E: it sorts last and bincount skips it.
        kept = (jnp.arange(t * top_k) % top_k) < active_k[token]
        flat = jnp.where(kept, flat, num_experts)
        token = jnp.where(kept, token, t)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, token[order], sizes
