"""The device-side state of a batch of sequences being decoded."""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class DecodeState:
    """Per-slot decode state. B = batch slots, P = page-table width, E = eos ids.

    Everything that varies between requests or steps is an array, never a Python value baked
    into the trace, so a new mix of requests reuses the compiled step.
    """

    tokens: jax.Array  # [B] int32 the last sampled token, fed at the next step
    lengths: jax.Array  # [B] int32 tokens already in the cache (= position of `tokens`)
    page_table: jax.Array  # [B, P] int32
    active: jax.Array  # [B] bool still generating
    num_generated: jax.Array  # [B] int32 tokens sampled so far, including the prefill's
    max_new_tokens: jax.Array  # [B] int32
    temperature: jax.Array  # [B] float32, 0 = greedy
    seeds: jax.Array  # [B] uint32
    stop_on_eos: jax.Array  # [B] bool (False with ignore_eos)
    eos_ids: jax.Array  # [E] int32, shared by all rows


@flax.struct.dataclass
class StepOutputs:
    """What `decode_steps` produced over K steps, for the host to collect."""

    tokens: jax.Array  # [K, B] int32 sampled tokens
    entropy: jax.Array  # [K, B] float32 model entropy (T = 1) of the distribution sampled from
    emitted: jax.Array  # [K, B] bool the row was active, so tokens[k, b] is real output
