"""Routed experts (a mixture-of-experts MLP): each token runs through the k experts its router
ranks highest, and through no other.

The T tokens' T*k (token, expert) pairs are sorted by expert, so that each expert's rows are
contiguous, and the experts' SwiGLU runs as two grouped matrix products over those rows
(`jax.lax.ragged_dot_general`: rows [T*k, D] against the stacked experts [E, 2M, D], with the
number of rows of each expert); each row's output is scaled by its routing weight and added
back to its token. The shapes are static whatever the routing: always T*k rows, so one
compiled step serves every batch of T tokens.

What the grouped product costs depends on its lowering. On TPU and GPU, JAX lowers it to XLA's
ragged dot (TPU's grouped-matmul kernels), which multiplies each row by its own expert only:
T*k rows' worth of products. XLA:CPU has no such instruction in JAX 0.10.2: JAX's default
lowering (`_ragged_dot_general_impl` in jax/_src/lax/lax.py) expands the rows to every expert,
masks the rows of other experts to zero and runs a dense product, E/k times the routed FLOPs.
The results are the same; the cost model (etjax/entropy/cost.py) counts the routed experts,
what an accelerator runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.layers import linear

# Rows [N, K] against groups [E, O, K] (output-major, as every etjax projection is): the rows
# are ragged along N, group e taking the next `group_sizes[e]` rows.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def route(
    x: jax.Array, router: jax.Array, top_k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """The experts each token runs and their weights.

    Args:
      x: [T, D] the normed hidden states.
      router: [E, D] the router's projection.
      top_k: experts per token (k).
      normalize: renormalise the k weights to sum to 1 (Qwen3-MoE's `norm_topk_prob`;
        Mixtral's softmax over its top-k logits is the same).

    Returns:
      weights [T, k] float32 (the softmax probabilities over all E experts of the k chosen,
      largest first) and experts [T, k] int32.
    """
    probs = jax.nn.softmax(linear(x, router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def routed_experts(
    x: jax.Array,
    router: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    top_k: int,
    normalize: bool,
) -> jax.Array:
    """The mixture-of-experts MLP of x [T, D] -> [T, D]: the sum over each token's top-k
    experts (`route`) of weight * down(silu(gate(x)) * up(x)).

    Args:
      router: [E, D]; w_gate_up: [E, 2M, D], rows gate | up of each expert; w_down: [E, D, M].
    """
    t = x.shape[0]
    num_experts = w_gate_up.shape[0]
    weights, experts = route(x, router, top_k, normalize)
    flat = experts.reshape(t * top_k)
    order = jnp.argsort(flat, stable=True)  # [T*k] pairs, grouped by expert
    token = order // top_k  # [T*k] the token of each grouped row
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E] rows per expert
    gate, up = jnp.split(_grouped(x[token], w_gate_up, sizes), 2, axis=-1)
    out = _grouped(jax.nn.silu(gate) * up, w_down, sizes)  # [T*k, D]
    scaled = (out.astype(jnp.float32) * weights.reshape(t * top_k)[order, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(scaled)


def _grouped(rows: jax.Array, groups: jax.Array, sizes: jax.Array) -> jax.Array:
    # rows [N, K] sorted by group, groups [E, O, K], sizes [E] summing to N -> [N, O]: row n
    # times its own group's matrix.
    return jax.lax.ragged_dot_general(
        rows, groups, sizes, _GROUPED, preferred_element_type=rows.dtype
    )
