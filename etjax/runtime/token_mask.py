"""Allowed-token bitmasks of constrained rows, on the device side of a step.

A constrained row's state holds the bitmask of the tokens its grammar allows next
(`DecodeState.allowed`, [B, W] uint32, bit i of word i // 32 = token i; all ones for an
unconstrained row). A step in a program compiled for constrained rows (`StepStatics.constrained`)
masks the logits with it before anything else reads them (penalties, temperature, truncation,
the entropic controller, the draw), and after the draw asks the host for each row's next mask
through `jax.experimental.io_callback`: the row's llguidance matcher consumes the drawn token
and computes the mask (etjax/constraints/matcher.py). A burst of K steps thus stays one
`lax.scan`, each step waiting only for the masks of its own draw; the callback is issued right
after the draw, before the forward pass it does not depend on, so a device may overlap the
two. Programs compiled without constrained rows contain none of this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from etjax.constraints import matcher


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens `allowed` [B, W] uint32 does not hold set to -inf."""
    b, v = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    ok = bits.reshape(b, -1)[:, :v].astype(bool)
    return jnp.where(ok, logits, -jnp.inf)


def next_masks(
    grammar: jax.Array,
    tokens: jax.Array,
    index: jax.Array,
    committed: jax.Array,
    width: int,
    only_committed: bool = False,
) -> jax.Array:
    """[B, W] uint32 each row's mask after its token `tokens[b]` (output token `index[b]`)
    was committed (`committed` [B] bool); all ones where `grammar` [B] is -1, and with
    `only_committed` where nothing was committed (the caller keeps those rows' masks)."""
    shape = jax.ShapeDtypeStruct((grammar.shape[0], width), jnp.uint32)
    host = functools.partial(matcher.advance, width=width, only_committed=only_committed)
    return io_callback(host, shape, grammar, tokens, index, committed, ordered=True)
