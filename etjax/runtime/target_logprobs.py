"""Log-probabilities of given next tokens at the positions of a flat batch (prompt logprobs).

A ragged step computes the LM head only where it samples (each row's token, each chunk's last
token). A request with `prompt_logprobs` needs it at every token of its chunks, against the
prompt token that follows. Running the head over the whole flat batch would make every step
that holds such a chunk pay for all of its tokens; instead the batch is cut into tiles and a
tile runs the head only when one of its tokens has a target. Chunks are contiguous in the flat
batch, so a request's tokens fill few tiles and the others skip: steps without such a request
compute nothing, and one asking chunk costs about its own length in head rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.transformer import logits_from_hidden
from etjax.model.weights import Weights

TILE = 64  # tokens per tile: a few head calls for a whole chunk, little waste at its edges


def target_logprobs(weights: Weights, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits(hidden[i]))[targets[i]] at T = 1, float32 [T]; 0 where
    `targets[i]` < 0 (no target). hidden: [T, D] the model's final hidden states; targets:
    [T] int32. T is a power of two (the ragged step's token bucket)."""
    num = hidden.shape[0]
    tile = min(TILE, num)

    def one_tile(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h, wanted = args  # [tile, D], [tile]
        asks = wanted >= 0

        def compute() -> jax.Array:
            logits = logits_from_hidden(weights, h)  # [tile, V] float32
            picked = jnp.take_along_axis(logits, jnp.maximum(wanted, 0)[:, None], axis=1)[:, 0]
            return jnp.where(asks, picked - jax.nn.logsumexp(logits, axis=-1), 0.0)

        return jax.lax.cond(jnp.any(asks), compute, lambda: jnp.zeros(tile, jnp.float32))

    tiles = (hidden.reshape(num // tile, tile, -1), targets.reshape(num // tile, tile))
    return jax.lax.map(one_tile, tiles).reshape(num)
