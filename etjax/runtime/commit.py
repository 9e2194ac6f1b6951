"""`commit_tokens`: what drawing a token does to a row's state, in one place.

A decode step commits the token each active row sampled; a verification pass (verify.py)
commits, draft after draft, the drafted tokens its rows' samplers drew again. Either way a
committed token counts towards the row's output and stop conditions, advances its sampler and
entropy state, and is charged its cost, exactly as the non-speculative step would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.calibration.signal import calibrated_entropy
from etjax.distributed.topk import top_k
from etjax.entropy.estimators import (
    entropy_and_log_normaliser,
    masked_entropy_and_log_normaliser,
)
from etjax.entropy.state import advance_tau
from etjax.request_fields import MAX_LOGPROBS
from etjax.runtime.options import FINISH_REASONS
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.token_mask import MaskedRows, mask_rows
from etjax.sampling.sampler import SampleInfo, SamplerState, sample_next


def sample_rows(
    state: DecodeState, masked: MaskedRows | None = None
) -> tuple[jax.Array, SampleInfo, SamplerState]:
    """Each row's next token drawn from its logits with its sampler, keyed by the token's
    index in the row's output (what makes a draw the same in any step that makes it), and
    the entropy signal of the distribution under the row's calibration (the draw reads the
    raw logits: calibration changes what the engine steers by, not what is sampled).
    `masked`: the rows whose `state.logits` are a grammar's masking of their logits
    (`mask_rows`); their sampled entropy is the masked distribution's, their raw entropy and
    signal the model's (pruning and the scheduler read the model, not the constraint), both
    from one pass over their vocabulary (`masked_entropy_and_log_normaliser`)."""
    entropy = raw = None
    if masked is not None and masked.rows is None:  # every row masked: one fused pass
        h_masked, log_z, raw = masked_entropy_and_log_normaliser(masked.raw, masked.ok)
        entropy = (h_masked, log_z)
    elif masked is not None:
        # The plain entropy of every row's (masked) logits, the masked rows' replaced by
        # their fused pass, which also gives their raw entropy.
        h, log_z = entropy_and_log_normaliser(state.logits)
        h_masked, log_z_masked, h_raw = masked_entropy_and_log_normaliser(masked.raw, masked.ok)
        entropy = (h.at[masked.rows].set(h_masked), log_z.at[masked.rows].set(log_z_masked))
        raw = h.at[masked.rows].set(h_raw)
    tokens, info, sampler_state = sample_next(
        state.logits,
        state.sampler,
        state.sampler_state,
        state.token_counts,
        state.in_prompt,
        state.num_generated,
        entropy,
    )
    # The signal is the raw logits' (calibration reads the model, not the constraint).
    if masked is None:
        raw = info.model_entropy
        signal = calibrated_entropy(state.logits, raw, state.calibration)
    elif masked.rows is None:
        signal = calibrated_entropy(masked.raw, raw, state.calibration)
    else:
        signal = calibrated_entropy(state.logits, raw, state.calibration)
        calibration = jax.tree.map(lambda x: x[masked.rows], state.calibration)
        signal = signal.at[masked.rows].set(calibrated_entropy(masked.raw, h_raw, calibration))
    return tokens, info.replace(calibrated_entropy=signal, raw_entropy=raw), sampler_state


def draw_rows(
    state: DecodeState, constrained: int = 0
) -> tuple[DecodeState, jax.Array, SampleInfo, SamplerState]:
    """`sample_rows` for a step or a draft check: with `constrained` > 0 (static, at most
    that many rows have a grammar), the active constrained rows' logits are masked first
    (`mask_rows`), and the state returned holds the masked logits; the raw logits stay the
    entropy signal's. Returns the state, the tokens [B], what the draw observed and the
    sampler state it left."""
    if not constrained:
        return (state, *sample_rows(state))
    # The grammar's mask comes before everything that reads the distribution (penalties,
    # temperature, truncation, the controller, the draw, the top-k).
    grammar_rows = state.active & (state.grammar >= 0)
    logits, masked = mask_rows(state.logits, state.allowed, grammar_rows, constrained)
    state = state.replace(logits=logits)
    return (state, *sample_rows(state, masked))


_EOS, _LENGTH = FINISH_REASONS.index("eos"), FINISH_REASONS.index("length")


def finish_code(state: DecodeState, tokens: jax.Array, take: jax.Array) -> jax.Array:
    """[B] int8, what the committed token `tokens` [B] of each row in `take` ends the row
    by (an index into FINISH_REASONS): an eos id, unless the row stops on none; else its
    last allowed token; 0 for neither. The one place the rule lives: the host reads it."""
    hit_eos = take & state.stop_on_eos & jnp.any(tokens[:, None] == state.eos_ids, axis=-1)
    last = take & (state.num_generated + take >= state.max_new_tokens)
    return jnp.where(hit_eos, _EOS, jnp.where(last, _LENGTH, 0)).astype(jnp.int8)


def finishes(state: DecodeState, tokens: jax.Array, take: jax.Array) -> jax.Array:
    """[B] bool: rows in `take` whose committed token `tokens` [B] ends them, so the token
    is not run."""
    return finish_code(state, tokens, take) > 0


def commit_tokens(
    state: DecodeState,
    tokens: jax.Array,
    info: SampleInfo,
    sampler_state: SamplerState,
    take: jax.Array,
    next_logits: jax.Array,
    fraction: jax.Array,
    kept: jax.Array,
    flops: jax.Array,
    nbytes: jax.Array,
) -> tuple[DecodeState, StepOutputs]:
    """Commit `tokens` [B] for the rows in `take` [B] bool; the other rows keep their state.

    info, sampler_state: what `sample_next` observed and left; next_logits: [B, V] the
    distribution after the token (used where it runs, i.e. does not finish the row);
    fraction, kept: the attention budget the token's pass used; flops, nbytes: its cost.
    Returns the state and the step's outputs (emitted = take).
    """
    finish = finish_code(state, tokens, take)
    runs = take & (finish == 0)
    top_ids, top_logprobs = top_logprobs_of(state, take)
    entropy = _advance_entropy(state, info, take, fraction, flops, nbytes)
    state = _advance_rows(state, tokens, sampler_state, take, runs, next_logits, entropy)
    outputs = StepOutputs(
        tokens=tokens,
        model_entropy=info.model_entropy,
        raw_entropy=info.raw_entropy,
        calibrated_entropy=info.calibrated_entropy,
        logprob=info.logprob,
        sampled_entropy=info.sampled_entropy,
        temperature=info.temperature,
        tau=entropy.tau,
        cost_flops=entropy.cost_flops,
        cost_bytes=entropy.cost_bytes,
        kept_blocks=jnp.where(runs, kept, 0).astype(jnp.int32),
        emitted=take,
        finish=finish,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
    return state, outputs


def _advance_entropy(state, info, take, fraction, flops, nbytes):
    # The rows' entropy state [B] after the token: the controller's tau, and where taken the
    # budget, the sampled entropy and the temperature; the cost (flops, nbytes [B]) charged.
    entropy = advance_tau(state.entropy, info.model_entropy, take)
    return entropy.replace(
        budget=jnp.where(take, fraction, entropy.budget),
        sampled_entropy=jnp.where(take, info.sampled_entropy, entropy.sampled_entropy),
        temperature=jnp.where(take, info.temperature, entropy.temperature),
        cost_flops=entropy.cost_flops + flops,
        cost_bytes=entropy.cost_bytes + nbytes,
    )


def _advance_rows(state, tokens, sampler_state, take, runs, next_logits, entropy):
    # The rows [B] after committing `tokens` where `take`: those that run on (runs [B]) get
    # the next logits [B, V] and one more position; each taken row counts the token and
    # keeps the sampler state the draw left.
    rows = jnp.arange(tokens.shape[0])
    return state.replace(
        logits=jnp.where(runs[:, None], next_logits, state.logits),
        lengths=state.lengths + runs,
        num_generated=state.num_generated + take,
        active=jnp.where(take, runs, state.active),
        token_counts=state.token_counts.at[rows, tokens].add(take.astype(jnp.int32)),
        sampler_state=jax.tree.map(
            lambda new, old: jnp.where(take, new, old), sampler_state, state.sampler_state
        ),
        entropy=entropy,
    )


def top_logprobs_of(state: DecodeState, take: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS most likely tokens [B, MAX_LOGPROBS] int32 of each row's logits (the
    distribution the committed token was drawn from, at T = 1 before penalties), most likely
    first, and their log-probabilities float32. Computed only when a row in `take` asks
    (`state.logprobs` > 0): a batch without logprobs skips the top-k at run time, without a
    program of its own; zeros then."""
    b, v = state.logits.shape
    k = min(MAX_LOGPROBS, v)

    def compute() -> tuple[jax.Array, jax.Array]:
        logits = state.logits.astype(jnp.float32)
        values, ids = top_k(logits, k)
        normaliser = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return ids.astype(jnp.int32), values - normaliser

    def skip() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    return jax.lax.cond(jnp.any(take & (state.logprobs > 0)), compute, skip)
