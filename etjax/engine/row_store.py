"""The row store: one `DecodeState` on the device holding every resident sequence's row.

`DeviceBackend` (device.py) keeps `rows + 1` rows (the last a never-active pad row that
padding slots point at); the step programs gather the rows they run and scatter them back
(etjax/runtime/steps.py). This module makes the store and writes, saves and restores a row:

- `NewRow`: what a new request's row starts with that the host knows (its settings, its
  prompt's tokens, its first mask, its prefill's cost), one pytree built by `new_row`.
  The row's description is `DecodeState` (etjax/runtime/state.py): the fields it declares
  `from_settings` (`SETTINGS`) are read, inserted and emptied here from that declaration,
  so a new request field the device reads is one line there and none here.
- `empty_store`, `new_row_state` and `put_row` (a new row, made then stored: a new
  sequence's first token is drawn in between, etjax/runtime/steps.py `first_token`),
  `restore_row`, `save_row`: the jitted programs.
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from etjax.calibration.signal import identity_params
from etjax.constraints.matcher import ALL_TOKENS, mask_words
from etjax.entropy.state import initial_entropy_state
from etjax.model.config import ModelConfig
from etjax.runtime.options import RequestSettings
from etjax.runtime.state import DecodeState
from etjax.runtime.steps import put_rows, take_rows
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import SamplerParams, pack_sampler_params

# The DecodeState fields a row reads from its request's settings (`from_settings`): each
# name with how it is read and its dtype.
SETTINGS = {
    f.name: (f.metadata["setting"], f.metadata["dtype"])
    for f in dataclasses.fields(DecodeState)
    if "setting" in f.metadata
}


@flax.struct.dataclass
class NewRow:
    """A new request's row as the host describes it; V = vocabulary, W = mask words."""

    length: jax.Array  # [] int32 tokens of context the row's KV pages hold
    sampler: SamplerParams  # [1] its sampler's settings
    settings: dict[str, jax.Array]  # [] each: the `SETTINGS` fields, read from its settings
    allowed: jax.Array  # [W] uint32 the tokens it may draw first (its grammar's, or all)
    grammar: jax.Array  # [] int32 its constraint's matcher, -1 for none
    in_prompt: jax.Array  # [1, V] bool the tokens of its prompt (for penalties)
    prefill_flops: jax.Array  # [] float32 what its prefill cost
    prefill_bytes: jax.Array  # [] float32
    calibration: jax.Array  # [1] the entropy signal's calibration (etjax/calibration)


def new_row(
    settings: RequestSettings,
    prompt: list[int],
    length: int,
    allowed: np.ndarray,
    grammar: int,
    prefill_flops: float,
    prefill_bytes: float,
    vocab_size: int,
    calibration: jax.Array,
) -> NewRow:
    """The `NewRow` of a request with these `settings` and `prompt`, whose context of
    `length` tokens was just prefilled."""
    in_prompt = np.zeros((1, vocab_size), bool)
    in_prompt[0, np.asarray(prompt, np.int64)] = True
    return NewRow(
        length=np.int32(length),
        sampler=pack_sampler_params([settings.sampler], 1, xp=np),
        settings={name: dtype(read(settings)) for name, (read, dtype) in SETTINGS.items()},
        allowed=allowed,
        grammar=np.int32(grammar),
        in_prompt=in_prompt,
        prefill_flops=np.float32(prefill_flops),
        prefill_bytes=np.float32(prefill_bytes),
        calibration=calibration,
    )


@jax.jit
def new_row_state(
    logits: jax.Array, index: jax.Array, new: NewRow, eos_ids: jax.Array
) -> DecodeState:
    """A fresh row [1]: `new`'s settings, no output yet, the prefill's cost counted, the
    shared eos ids (E) along. logits: [Sp, V] of the step that finished its context, row
    `index` its own. `put_row` makes it a row of the store; a new sequence's row may draw
    its first token (etjax/runtime/steps.py `first_token`) in between."""
    return DecodeState(
        logits=logits[index][None],
        lengths=new.length[None],
        page_table=None,
        active=jnp.ones(1, bool),
        num_generated=jnp.zeros(1, jnp.int32),
        eos_ids=eos_ids,
        token_counts=jnp.zeros((1, logits.shape[1]), jnp.int32),
        in_prompt=new.in_prompt,
        allowed=new.allowed[None],
        grammar=new.grammar[None],
        sampler=new.sampler,
        sampler_state=initial_sampler_state(new.sampler),
        entropy=initial_entropy_state(new.prefill_flops[None], new.prefill_bytes[None]),
        calibration=new.calibration,
        pending=jnp.full(1, -1, jnp.int32),
        **{name: value[None] for name, value in new.settings.items()},
    )


@functools.partial(jax.jit, donate_argnums=0)
def put_row(store: DecodeState, row: jax.Array, one: DecodeState) -> DecodeState:
    """`store` with row `row` [] int32 replaced by `one` [1] (its eos ids aside)."""
    return put_rows(store, row[None], one)


@functools.partial(jax.jit, donate_argnums=0)
def restore_row(store, row, logits, index, length, saved, flops, nbytes) -> DecodeState:
    """A preempted row back: its `saved` state, the recomputed prefill's cost added. A token it
    held pending is in the recomputed context now (the host's context is every token it
    committed), so it holds none."""
    entropy = saved.entropy
    one = saved.replace(
        logits=logits[index][None],
        lengths=length[None],
        pending=jnp.full(1, -1, jnp.int32),
        entropy=entropy.replace(
            cost_flops=entropy.cost_flops + flops, cost_bytes=entropy.cost_bytes + nbytes
        ),
    )
    return put_rows(store, row[None], one)


@jax.jit
def save_row(store: DecodeState, row: jax.Array) -> DecodeState:
    """Row `row` of the store, less what a restore gets anew (logits, length, eos ids)."""
    one = take_rows(store, row[None])
    return one.replace(logits=None, lengths=None, eos_ids=None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def empty_store(cfg: ModelConfig, rows: int, eos_ids: tuple[int, ...]) -> DecodeState:
    """A store of `rows` inactive rows. One program (eager zeros would compile one small
    program per shape and dtype)."""
    params = pack_sampler_params([], rows)
    zeros = np.zeros(rows, np.float32)
    return DecodeState(
        logits=jnp.zeros((rows, cfg.vocab_size), jnp.float32),
        lengths=jnp.zeros(rows, jnp.int32),
        page_table=jnp.zeros((rows, 1), jnp.int32),
        active=jnp.zeros(rows, bool),
        num_generated=jnp.zeros(rows, jnp.int32),
        eos_ids=jnp.asarray(eos_ids, jnp.int32),
        token_counts=jnp.zeros((rows, cfg.vocab_size), jnp.int32),
        in_prompt=jnp.zeros((rows, cfg.vocab_size), bool),
        allowed=jnp.full((rows, mask_words(cfg.vocab_size)), ALL_TOKENS, jnp.uint32),
        grammar=jnp.full(rows, -1, jnp.int32),
        sampler=params,
        sampler_state=initial_sampler_state(params),
        entropy=initial_entropy_state(jnp.asarray(zeros), jnp.asarray(zeros.copy())),
        calibration=identity_params(rows),
        pending=jnp.full(rows, -1, jnp.int32),
        **{name: jnp.zeros(rows, dtype) for name, (_, dtype) in SETTINGS.items()},
    )
