"""`EntropyState`: the entropy signal and its consequences, threaded through every decode step."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class EntropyState:
    """Per-row entropy bookkeeping. B = batch.

    tau is entropic time: the sum over steps of dH+ = max(0, H_{t-1} - H_t), model entropy at
    T = 1, so it advances only when uncertainty falls. Costs follow `etjax.entropy.cost`.
    """

    prev_entropy: jax.Array  # [B] model entropy of the previous token's distribution
    has_prev: jax.Array  # [B] bool, False until the first token is drawn
    sampled_entropy: jax.Array  # [B] entropy of the last distribution sampled from
    temperature: jax.Array  # [B] last temperature used (0 = greedy)
    tau: jax.Array  # [B] entropic time, nats
    budget: jax.Array  # [B] fraction of KV pages the next step may read (1 = dense)
    cost_flops: jax.Array  # [B] cumulative FLOPs
    cost_bytes: jax.Array  # [B] cumulative bytes read


def initial_entropy_state(cost_flops: jax.Array, cost_bytes: jax.Array) -> EntropyState:
    """State before the first token, with the prompt's (prefill) cost already counted."""
    # Distinct buffers per field: the decode step donates its state, and XLA refuses to donate
    # one buffer twice.
    shape = cost_flops.shape
    return EntropyState(
        prev_entropy=jnp.zeros(shape, jnp.float32),
        has_prev=jnp.zeros(shape, bool),
        sampled_entropy=jnp.zeros(shape, jnp.float32),
        temperature=jnp.zeros(shape, jnp.float32),
        tau=jnp.zeros(shape, jnp.float32),
        budget=jnp.ones(shape, jnp.float32),
        cost_flops=cost_flops,
        cost_bytes=cost_bytes,
    )


def advance_tau(state: EntropyState, entropy: jax.Array, active: jax.Array) -> EntropyState:
    """Count the entropy drop to `entropy` [B] for `active` rows and remember it."""
    drop = jnp.where(state.has_prev, jnp.maximum(state.prev_entropy - entropy, 0.0), 0.0)
    return state.replace(
        tau=state.tau + jnp.where(active, drop, 0.0),
        prev_entropy=jnp.where(active, entropy, state.prev_entropy),
        has_prev=state.has_prev | active,
    )
