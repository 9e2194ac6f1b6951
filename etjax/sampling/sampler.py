"""One sampling step: from a row's logits to its next token, under its own sampler.

Order of operations per row: model entropy (T = 1, the engine's control signal) -> penalties ->
temperature (fixed, EDT, or the entropic controller) -> truncation filters -> draw -> the
entropy of the distribution actually drawn from -> Mirostat's mu update.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from etjax.entropy.controller import (
    BaseEntropy,
    ControllerStep,
    controller_step,
    no_base_entropy,
)
from etjax.entropy.estimators import entropy_and_log_normaliser, exact_entropy
from etjax.sampling.filters import apply_penalties, truncate
from etjax.sampling.settings import EDT, ENTROPIC, MIROSTAT_V2, SamplerParams

_LOG2 = 0.6931471805599453
# Control-law applications per token: each is one O(V) entropy evaluation. Two follow most of
# the token-to-token change of an LM's distribution (docs/STABILITY.md, tracking).
CONTROLLER_ITERATIONS = 2


@flax.struct.dataclass
class SamplerState:
    """Per-row state of the adaptive samplers. B = batch."""

    log_temperature: jax.Array  # [B] the entropic controller's state, log T
    mirostat_mu: jax.Array  # [B] Mirostat v2's truncation bound, bits
    base_entropy: BaseEntropy  # [B] the controller's tracking target (`target_from_temperature`)


@flax.struct.dataclass
class SampleInfo:
    """What one sampling step observed. B = batch."""

    model_entropy: jax.Array  # [B] H of softmax(logits), T = 1, before penalties
    logprob: jax.Array  # [B] log-probability of the drawn token under softmax(logits), T = 1
    sampled_entropy: jax.Array  # [B] H of the distribution the token was drawn from (0: greedy)
    temperature: jax.Array  # [B] temperature used (0 = greedy)
    # [B] the entropy signal the engine's levels read (pruning, scheduler, drafting): the
    # model entropy here; its calibration where one is loaded (etjax/runtime/commit.py).
    calibrated_entropy: jax.Array
    # [B] H of the model's distribution over the whole vocabulary: model_entropy, unless the
    # row's logits were masked by a grammar (etjax/runtime/commit.py).
    raw_entropy: jax.Array


def initial_sampler_state(p: SamplerParams) -> SamplerState:
    """Controller starts at the request's temperature (clipped); Mirostat's mu at 2 * tau."""
    start = jnp.where(p.temperature > 0, p.temperature, 1.0)
    c = p.controller
    return SamplerState(
        log_temperature=jnp.clip(jnp.log(start), c.log_t_min, c.log_t_max),
        mirostat_mu=2.0 * p.mirostat_tau,
        base_entropy=no_base_entropy(p.temperature),
    )


def sample_next(
    logits: jax.Array,
    p: SamplerParams,
    state: SamplerState,
    counts: jax.Array,
    in_prompt: jax.Array,
    token_index: jax.Array,
    entropy: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, SampleInfo, SamplerState]:
    """Draw one token per row.

    logits: [B, V]; counts: [B, V] int32 output-token counts; in_prompt: [B, V] bool;
    token_index: [B] int32 index of the token being drawn (keys the row's random stream).
    entropy: the entropy [B] and log-sum-exp [B] of softmax(logits), where the caller has
    them already (a constrained step computes them beside the model's own in one pass:
    etjax/runtime/commit.py); None computes them here.
    Returns tokens [B] int32, what was observed, and the updated sampler state.
    """
    logits = logits.astype(jnp.float32)
    if entropy is None:
        entropy = entropy_and_log_normaliser(logits)
    model_entropy, log_normaliser = entropy
    z = apply_penalties(logits, p, counts, in_prompt)

    entropic = p.kind == ENTROPIC
    # The controller costs CONTROLLER_ITERATIONS + 1 passes over the vocabulary: only batches
    # holding an entropic request pay them.
    control = jax.lax.cond(
        jnp.any(entropic),
        lambda: controller_step(
            z,
            model_entropy,
            state.log_temperature,
            p.controller,
            CONTROLLER_ITERATIONS,
            state.base_entropy,
        ),
        lambda: ControllerStep(
            temperature=jnp.exp(state.log_temperature),
            sampled_entropy=jnp.zeros_like(model_entropy),
            log_temperature=state.log_temperature,
            base=state.base_entropy,
        ),
    )
    # EDT: T = T0 * N^(theta / H). As H -> 0 the power vanishes (N < 1): greedy when certain.
    edt_t = p.edt_t0 * jnp.power(p.edt_base, p.edt_theta / jnp.maximum(model_entropy, 1e-6))
    temperature = jnp.where(entropic, control.temperature, p.temperature)
    temperature = jnp.where(p.kind == EDT, edt_t, temperature)
    greedy = temperature <= 1e-6

    best = first_argmax(z)
    mirostat = (p.kind == MIROSTAT_V2) & ~greedy

    def sample() -> tuple[jax.Array, jax.Array, jax.Array]:
        x = z / jnp.where(greedy, 1.0, temperature)[:, None]
        x = truncate(x, p, state.mirostat_mu)
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            p.seed, token_index
        )
        tokens = jnp.where(greedy, best, inverse_cdf_sample(x, jax.vmap(jax.random.uniform)(keys)))

        def update_mu() -> jax.Array:
            # Observed surprise of the drawn token under the truncated distribution, in bits.
            log_probs = jax.nn.log_softmax(x, axis=-1)
            surprise = -jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0] / _LOG2
            mu = state.mirostat_mu - p.mirostat_eta * (surprise - p.mirostat_tau)
            return jnp.where(mirostat, mu, state.mirostat_mu)

        mu = jax.lax.cond(jnp.any(mirostat), update_mu, lambda: state.mirostat_mu)
        return tokens, jnp.where(greedy, 0.0, exact_entropy(x)), mu

    def pick_best() -> tuple[jax.Array, jax.Array, jax.Array]:
        return best, jnp.zeros_like(model_entropy), state.mirostat_mu

    # One branch for everything a sampling row needs (scaling, truncation, the draw, its
    # entropy, Mirostat's update): an all-greedy batch skips it at run time, without a second
    # compiled program, and XLA moves the [B, V] intermediates across one branch, not several.
    tokens, sampled_entropy, mirostat_mu = jax.lax.cond(jnp.any(~greedy), sample, pick_best)
    new_state = SamplerState(
        log_temperature=jnp.where(entropic, control.log_temperature, state.log_temperature),
        mirostat_mu=mirostat_mu,
        base_entropy=control.base,
    )
    model_logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_normaliser
    info = SampleInfo(
        model_entropy=model_entropy,
        logprob=model_logprob,
        sampled_entropy=sampled_entropy,
        temperature=jnp.where(greedy, 0.0, temperature),
        calibrated_entropy=model_entropy,
        raw_entropy=model_entropy,
    )
    return tokens, info, new_state


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis, [B, V] -> [B] int32 (the first index on ties).

    A max and a min over an index mask: two plain reductions, which XLA:CPU vectorises, where
    `jnp.argmax`'s paired (value, index) reduction runs ~2x slower.
    """
    v = x.shape[-1]
    peak = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(v, dtype=jnp.int32)
    return jnp.min(jnp.where(x == peak, index, v), axis=-1).clip(0, v - 1)


def inverse_cdf_sample(x: jax.Array, uniform: jax.Array, chunk: int = 256) -> jax.Array:
    """Draw one token per row from softmax(x) [B, V] by inverting its CDF at `uniform` [B].

    Exact sampling with one random number per row instead of a Gumbel variate per token: the
    vocabulary is cut into chunks, the chunk holding the quantile is found from the chunk sums,
    and the token from a cumulative sum inside that chunk only. -inf entries are never drawn.
    """
    b, v = x.shape
    pad = (-v) % chunk
    w = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, pad)))
    chunks = w.reshape(b, -1, chunk)
    sums = jnp.sum(chunks, axis=-1)  # [B, C]
    cumulative = jnp.cumsum(sums, axis=-1)
    target = uniform * cumulative[:, -1]
    c = jnp.minimum(jnp.sum(cumulative <= target[:, None], axis=-1), sums.shape[1] - 1)
    before = jnp.take_along_axis(cumulative - sums, c[:, None], axis=1)
    inner = jnp.cumsum(jnp.take_along_axis(chunks, c[:, None, None], axis=1)[:, 0], axis=-1)
    j = jnp.minimum(jnp.sum(inner + before <= target[:, None], axis=-1), chunk - 1)
    token = (c * chunk + j).astype(jnp.int32)
    # Rounding at the very top of the CDF can land on a zero-weight pad or masked token.
    drawn = jnp.take_along_axis(w, token[:, None], axis=1)[:, 0]
    return jnp.where(drawn > 0, token, first_argmax(x))
