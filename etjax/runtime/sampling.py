"""Next-token sampling and the model-entropy signal, vectorised over a batch.

Each row carries its own temperature and seed, so greedy and sampled requests share one batch
without recompiling. A row's random key is derived from its seed and the index of the token
being generated, never from its batch slot, so a request samples the same tokens alone or
batched with others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def model_entropy(logits: jax.Array) -> jax.Array:
    """Exact entropy in nats of softmax(logits) (temperature 1) per row.

    logits: [B, V] float32; `-inf` entries are allowed. Returns [B] float32.
    """
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    log_p = logits - log_z
    p = jnp.exp(log_p)
    # 0 * log 0 := 0: masked entries (-inf logits) must not turn the sum into NaN.
    return -jnp.sum(jnp.where(p > 0, p * log_p, 0.0), axis=-1)


def sample_tokens(
    logits: jax.Array, temperature: jax.Array, seeds: jax.Array, token_index: jax.Array
) -> jax.Array:
    """Pick one token per row: argmax where temperature is 0, else softmax(logits / T) sampling.

    logits: [B, V] float32; temperature: [B] float32 >= 0; seeds: [B] uint32; token_index: [B]
    int32, the index among generated tokens of the one being drawn. Returns [B] int32.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def with_sampling() -> jax.Array:
        safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]

        def draw(row_logits: jax.Array, seed: jax.Array, index: jax.Array) -> jax.Array:
            key = jax.random.fold_in(jax.random.key(seed), index)
            return jax.random.categorical(key, row_logits).astype(jnp.int32)

        sampled = jax.vmap(draw)(logits / safe_t, seeds, token_index)
        return jnp.where(temperature > 0, sampled, greedy)

    # Drawing Gumbel noise for a whole vocabulary costs more than the argmax on CPU; an all-greedy
    # batch (benchmarks, most evaluation) skips it at run time without a second compiled program.
    return jax.lax.cond(jnp.any(temperature > 0), with_sampling, lambda: greedy)
