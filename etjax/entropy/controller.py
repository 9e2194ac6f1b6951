"""The micro level: a feedback controller that holds the sampling entropy near a target.

The controller acts on u = log T. Each step it measures the entropy of the distribution it is
about to sample from, H_s = H(softmax(z / T)), and moves u against the error:

    u <- clip(u + clip(gain * (H* - H_s), -max_step, max_step), log T_min, log T_max)

Entropy is nondecreasing in u with slope equal to the varentropy, so this is integral control
on a monotone plant: docs/STABILITY.md proves boundedness for any input, convergence to H* for
a stationary distribution when gain <= 1 / max varentropy over [T_min, T_max], and saturation at
T_min or T_max when H* is out of reach. Clipping u itself is the anti-windup: the integrator
never accumulates error it cannot act on.

Bands reconcile "be precise when sure, explore when unsure": below `entropy_floor` (model
entropy, T = 1) the step is sampled greedily and u is frozen; in the middle band T = exp(u)
holds H*; at the top T is capped at T_max.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from etjax.entropy.estimators import exact_entropy


@flax.struct.dataclass
class ControllerParams:
    """Per-request controller settings, one row per sequence. B = batch."""

    target_entropy: jax.Array  # [B] H*, nats
    log_t_min: jax.Array  # [B] log T_min
    log_t_max: jax.Array  # [B] log T_max
    gain: jax.Array  # [B] nats^-1: change of log T per nat of error
    max_step: jax.Array  # [B] largest change of log T in one step (rate limit)
    entropy_floor: jax.Array  # [B] model entropy below which the step is greedy


@flax.struct.dataclass
class ControllerStep:
    """What one controller step decided. B = batch."""

    temperature: jax.Array  # [B] temperature sampled with this step (0 = greedy, floor band)
    sampled_entropy: jax.Array  # [B] entropy of the distribution actually sampled from
    log_temperature: jax.Array  # [B] controller state for the next step


def controller_step(
    logits: jax.Array, model_entropy: jax.Array, log_temperature: jax.Array, p: ControllerParams
) -> ControllerStep:
    """Apply the controller to one step's logits [B, V] (model_entropy [B] at T = 1).

    Uses the current state `log_temperature` [B] to sample this step and returns the state for
    the next. Rows whose logits are degenerate (all -inf but one, or NaN-free extremes) stay
    finite: the entropies are computed with 0 log 0 = 0 and u is always clipped.
    """
    temperature = jnp.exp(log_temperature)
    sampled_entropy = exact_entropy(logits, temperature)
    error = p.target_entropy - sampled_entropy
    step = jnp.clip(p.gain * error, -p.max_step, p.max_step)
    updated = jnp.clip(log_temperature + step, p.log_t_min, p.log_t_max)
    in_floor = model_entropy < p.entropy_floor
    return ControllerStep(
        temperature=jnp.where(in_floor, 0.0, temperature),
        sampled_entropy=jnp.where(in_floor, 0.0, sampled_entropy),
        log_temperature=jnp.where(in_floor, log_temperature, updated),
    )


def initial_log_temperature(params: ControllerParams, temperature: jax.Array) -> jax.Array:
    """The starting state: log of the request's temperature, clipped into [T_min, T_max]."""
    safe = jnp.log(jnp.maximum(temperature, 1e-6))
    return jnp.clip(safe, params.log_t_min, params.log_t_max)
