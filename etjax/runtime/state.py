"""The device-side state of a batch of sequences being decoded."""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import numpy as np

from etjax.calibration.signal import CalibrationParams
from etjax.entropy.state import EntropyState
from etjax.sampling.sampler import SamplerState
from etjax.sampling.settings import SamplerParams


def from_settings(read: Callable[[object], object], dtype: type) -> object:
    """A `DecodeState` field a row reads from its request's settings (`RequestSettings`):
    `read(settings)` as `dtype` when the row is inserted, 0 in an empty row
    (etjax/engine/row_store.py writes both from this declaration alone)."""
    return flax.struct.field(metadata={"setting": read, "dtype": dtype})


@flax.struct.dataclass
class DecodeState:
    """Per-slot decode state. B = batch slots, P = page-table width, V = vocabulary, E = eos ids.

    The state holds the logits of each row's next token rather than its last token: a step
    samples from them, then runs the model on the sampled token. A new row's first token is
    the exception: the ragged step that ran its prompt's last chunk drew and committed it
    (etjax/runtime/steps.py `mixed_step`), so the row enters its next step holding it in
    `pending`, which that step runs instead of sampling (its `logits` are still the prompt's,
    its `lengths` do not count the token yet). Everything that varies between
    requests or steps is an array, never a Python value baked into the trace, so a new mix of
    requests reuses the compiled step. A field read from the request's settings is declared
    `from_settings`: a new request field the device reads is one such line here, its line in
    etjax/request_fields.py (and `decode()`'s keyword), and the code where it acts.
    """

    logits: jax.Array  # [B, V] float32 distribution of the next token
    lengths: jax.Array  # [B] int32 tokens already in the cache
    page_table: jax.Array  # [B, P] int32
    active: jax.Array  # [B] bool still generating
    num_generated: jax.Array  # [B] int32 tokens sampled so far
    max_new_tokens: jax.Array = from_settings(lambda s: s.max_new_tokens, np.int32)  # [B]
    stop_on_eos: jax.Array = from_settings(lambda s: not s.ignore_eos, np.bool_)  # [B]
    eos_ids: jax.Array  # [E] int32, shared by all rows
    token_counts: jax.Array  # [B, V] int32 occurrences of each token in the output
    in_prompt: jax.Array  # [B, V] bool token occurs in the prompt (repetition penalty)
    # [B] int32 top log-probabilities the row reports per token (0: none). An array, not a
    # static: any mix of k shares one program, which computes MAX_LOGPROBS and the host keeps k.
    logprobs: jax.Array = from_settings(lambda s: s.logprobs, np.int32)
    # [B, W] uint32 bitmask of the tokens the row's grammar allows next (W = ceil(V / 32);
    # all ones for an unconstrained row), and [B] int32 the id of its host matcher (-1: none).
    # Read only by programs compiled for constrained rows (etjax/runtime/token_mask.py).
    allowed: jax.Array
    grammar: jax.Array
    sampler: SamplerParams
    sampler_state: SamplerState  # the adaptive samplers' state (controller, Mirostat)
    entropy: EntropyState
    calibration: CalibrationParams  # the entropy signal's calibration (T = 1: none)
    # [B] int32 a token committed but not yet run (the first token, drawn by the step that
    # ran the prompt's last chunk), -1 for none; None in states outside the engine's store.
    pending: jax.Array | None = None


@flax.struct.dataclass
class StepOutputs:
    """What `decode_steps` produced over K steps, for the host to collect. All [K, B]."""

    tokens: jax.Array  # int32 sampled tokens
    # float32 entropy at T = 1 of the distribution sampled from: for a constrained row, the
    # model's renormalised over the tokens its grammar allows
    model_entropy: jax.Array
    raw_entropy: jax.Array  # float32 the model's entropy over the whole vocabulary, T = 1
    # float32 the signal pruning, the scheduler and drafting read: model_entropy, or its
    # calibration (etjax/calibration/signal.py) where one is loaded
    calibrated_entropy: jax.Array
    logprob: jax.Array  # float32 log-probability of the token under that distribution (T = 1)
    sampled_entropy: jax.Array  # float32 entropy of the distribution actually sampled
    temperature: jax.Array  # float32 temperature used (0 = greedy)
    tau: jax.Array  # float32 entropic time after the step
    cost_flops: jax.Array  # float32 cumulative FLOPs after the step
    cost_bytes: jax.Array  # float32 cumulative bytes after the step
    kept_blocks: jax.Array  # int32 blocks per layer and KV head the token's forward pass read
    emitted: jax.Array  # bool the row was active, so tokens[k, b] is real output
    finish: jax.Array  # int8 what the token ended: an index into FINISH_REASONS (0: nothing)
    # [K, B, MAX_LOGPROBS] the most likely tokens at T = 1 before penalties, most likely
    # first, and their log-probabilities; zeros in steps where no row asked (commit.py). None
    # only from test doubles whose requests never ask.
    top_ids: jax.Array | None = None  # int32
    top_logprobs: jax.Array | None = None  # float32
    # float32 blocks of kept_blocks read once for the token's group of pruned rows sharing a
    # prefix, less its share (etjax/pruning/groups.py); None: no step of the call grouped.
    spared_blocks: jax.Array | None = None
