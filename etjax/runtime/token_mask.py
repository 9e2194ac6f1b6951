"""Allowed-token bitmasks of constrained rows, on the device side of a step.

A constrained row's state holds the bitmask of the tokens its grammar allows next
(`DecodeState.allowed`, [B, W] uint32, bit i of word i // 32 = token i; all ones for an
unconstrained row). A step in a program compiled for constrained rows
(`StepStatics.constrained`) masks their logits with it before anything else reads them
(penalties, temperature, truncation, the entropic controller, the draw): the constrained rows
only, gathered (`mask_rows`), so the mask and the masked rows' two entropies cost those rows,
not the batch. After the draw it hands the drawn tokens to the host (`start_masks`, an
ordered `jax.experimental.io_callback` that returns at once): the rows' llguidance matchers
consume them and compute the next masks on a host thread
(etjax/constraints/matcher.py) while the device runs the model on the tokens, and the step
collects the masks after the model's pass (`collect_masks`, a second ordered callback, which
waits only for what is not done yet). A burst of K steps thus stays one `lax.scan`.

Two callbacks rather than one: XLA:CPU runs a callback alone when control flow follows it (the
step's `lax.cond` around the model, the layer scan), so a single callback issued before the
pass it does not depend on still ran before it, and the host's time added to the step's
(measured in docs/ARCHITECTURE.md, token_mask.py); an accelerator's stream waits for a
callback the same way. Data pins the order (XLA:CPU drops optimization barriers): the pass reads
its input as the first callback returns it, and the second callback takes an element of the
pass's result. Programs compiled without constrained rows contain none
of this.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from etjax.constraints import matcher


def allowed_tokens(allowed: jax.Array, vocab_size: int) -> jax.Array:
    """[B, vocab_size] bool: the tokens the masks `allowed` [B, W] uint32 hold."""
    b = allowed.shape[0]
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(b, -1)[:, :vocab_size].astype(bool)


def mask_logits(logits: jax.Array, ok: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens `ok` [B, V] bool (`allowed_tokens`) does not hold set
    to -inf."""
    return jnp.where(ok, logits, -jnp.inf)


@flax.struct.dataclass
class MaskedRows:
    """The rows a constrained step masks: `rows` [C] int32 their indices in the batch (None:
    every row), `raw` [C, V] their logits before the mask, `ok` [C, V] bool the tokens their
    masks allow. C is static (`StepStatics.constrained`, a power of two at least the call's
    constrained rows): the mask, the masked entropy and the raw one cost C rows of the
    vocabulary, not the batch's, so unconstrained rows beside one constrained row pay
    little. Slots beyond the constrained rows repeat the first; a row whose mask allows
    everything is the same masked or not, so any extra slot is harmless."""

    rows: jax.Array | None
    raw: jax.Array
    ok: jax.Array


def mask_rows(logits: jax.Array, allowed: jax.Array, masked: jax.Array, count: int):
    """(logits [B, V] with the rows in `masked` [B] bool (at most `count` of them) masked by
    their `allowed` [B, W] words, MaskedRows). With `count` >= B every row is masked in place:
    gathering and scattering back a whole batch cost more than masking the unconstrained
    rows by their all-ones masks (a 32-row sampling stage on the 2-core CPU: 30.5 ms
    gathered against 23.1 in place, medians of 40 calls, docs/ARCHITECTURE.md)."""
    b, v = logits.shape
    if count >= b:
        ok = allowed_tokens(allowed, v)
        return mask_logits(logits, ok), MaskedRows(rows=None, raw=logits, ok=ok)
    index = jnp.nonzero(masked, size=count, fill_value=-1)[0]
    index = jnp.where(index >= 0, index, jnp.maximum(index[0], 0)).astype(jnp.int32)
    raw = logits[index]
    ok = allowed_tokens(allowed[index], v)
    return logits.at[index].set(mask_logits(raw, ok)), MaskedRows(rows=index, raw=raw, ok=ok)


def start_masks(
    grammar: jax.Array,
    tokens: jax.Array,
    index: jax.Array,
    committed: jax.Array,
    width: int,
    only_committed: bool = False,
    overlap=None,
):
    """Hand the host each row's token `tokens[b]` (output token `index[b]`), committed where
    `committed` [B] bool, for the masks after it (`collect_masks`): the host advances the rows'
    matchers (`grammar` [B], -1 unconstrained) and computes the masks while the device goes
    on. `overlap`: the inputs of the work to run meanwhile (default `tokens`), which come back
    through the callback, so that the work reading the returned copies starts after the
    hand-over; returned with a ticket [] int32 for `collect_masks`. `only_committed`: the
    masks of rows that committed nothing are not computed (the caller keeps theirs)."""
    overlap = tokens if overlap is None else overlap
    leaves, tree = jax.tree.flatten(overlap)
    host = functools.partial(_start, width=width, only_committed=only_committed)
    shapes = [jax.ShapeDtypeStruct((), jnp.int32)]
    shapes += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    ticket, *leaves = io_callback(
        host, shapes, grammar, tokens, index, committed, *leaves, ordered=True
    )
    return jax.tree.unflatten(tree, leaves), ticket


def collect_masks(ticket: jax.Array, after: jax.Array, rows: int, width: int) -> jax.Array:
    """[rows, W] uint32 the masks of `start_masks`'s `ticket`, asked for once `after` (the
    result of the work they overlap) is computed: each row's mask after its committed token;
    all ones for unconstrained rows, and, with `only_committed`, for rows that committed
    nothing."""
    # An element of `after` rides along so that the callback waits for it (XLA:CPU drops
    # optimization barriers, and with them any order they were to impose).
    anchor = after.reshape(-1)[:1]
    shape = jax.ShapeDtypeStruct((rows, width), jnp.uint32)
    return io_callback(_collect, shape, ticket, anchor, ordered=True)


def _start(grammar, tokens, index, committed, *passed, width, only_committed):
    # The ticket, and `passed` back unchanged.
    ticket = matcher.start_advance(grammar, tokens, index, committed, width, only_committed)
    return (ticket, *(np.array(x) for x in passed))


def _collect(ticket, anchor):
    del anchor
    return matcher.collect_advance(ticket)
