"""The jitted device programs: a prefill chunk, and K decode steps in one `lax.scan`.

Both donate the KV cache so pages are updated in place. Shapes are bucketed by the caller
(`buckets.py`), so a run with varied prompts compiles a handful of programs once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from etjax.cache.kv_cache import KVCache
from etjax.model.config import ModelConfig
from etjax.model.transformer import forward, logits_from_hidden
from etjax.model.weights import Weights
from etjax.runtime.sampling import model_entropy, sample_tokens
from etjax.runtime.state import DecodeState, StepOutputs


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def prefill_chunk(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    num_valid: jax.Array,
    page_table: jax.Array,
    temperature: jax.Array,
    seeds: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Append a chunk of prompt tokens per row and sample from the chunk's last position.

    tokens: [B, S] int32 (padded); starts: [B] int32 position of tokens[:, 0]; num_valid: [B]
    int32 real tokens in the chunk (0 for padding rows); page_table: [B, P].
    Returns the sampled token [B] int32 and its model entropy [B] float32 (meaningful only for
    rows whose chunk ends their prompt), and the updated cache.
    """
    s = tokens.shape[1]
    offsets = jnp.arange(s, dtype=jnp.int32)[None, :]
    positions = starts[:, None] + offsets
    valid = offsets < num_valid[:, None]
    hidden, cache = forward(weights, cache, tokens, positions, valid, page_table, cfg)
    last = jnp.clip(num_valid - 1, 0, s - 1)
    logits = logits_from_hidden(weights, jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0])
    first_index = jnp.zeros_like(num_valid)
    return (
        sample_tokens(logits, temperature, seeds, first_index),
        model_entropy(logits),
        cache,
    )


@functools.partial(
    jax.jit, static_argnames=("cfg", "num_steps"), donate_argnames=("cache", "state")
)
def decode_steps(
    weights: Weights, cache: KVCache, state: DecodeState, cfg: ModelConfig, num_steps: int
) -> tuple[DecodeState, KVCache, StepOutputs]:
    """Run `num_steps` decode steps for every active row; finished rows idle in place.

    A row finishes when it samples an eos id (unless `stop_on_eos` is off) or reaches its
    `max_new_tokens`. Returns the new state, the cache, and per-step outputs [num_steps, B].
    """

    def step(carry: tuple[DecodeState, KVCache], _: None):
        state, cache = carry
        hidden, cache = forward(
            weights,
            cache,
            state.tokens[:, None],
            state.lengths[:, None],
            state.active[:, None],
            state.page_table,
            cfg,
        )
        logits = logits_from_hidden(weights, hidden[:, 0])
        next_tokens = sample_tokens(logits, state.temperature, state.seeds, state.num_generated)
        num_generated = state.num_generated + state.active
        hit_eos = state.stop_on_eos & jnp.any(next_tokens[:, None] == state.eos_ids, axis=-1)
        done = hit_eos | (num_generated >= state.max_new_tokens)
        outputs = StepOutputs(
            tokens=next_tokens, entropy=model_entropy(logits), emitted=state.active
        )
        state = state.replace(
            tokens=jnp.where(state.active, next_tokens, state.tokens),
            lengths=state.lengths + state.active,
            num_generated=num_generated,
            active=state.active & ~done,
        )
        return (state, cache), outputs

    (state, cache), outputs = jax.lax.scan(step, (state, cache), None, length=num_steps)
    return state, cache, outputs
