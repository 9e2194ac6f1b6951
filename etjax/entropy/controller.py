"""The micro level: a feedback controller that holds the sampling entropy near a target.

The controller acts on u = log T. It measures the entropy the current logits z would have at
its temperature, H_s = H(softmax(z / e^u)), and moves u against the error:

    u <- clip(u + clip(gain * (H* - H_s), -max_step, max_step), log T_min, log T_max)

then samples at the new temperature; the law can be applied more than once per token
(`iterations`) to follow a distribution that changes from token to token.

Entropy is nondecreasing in u with slope equal to the varentropy, so this is integral control
on a monotone plant: docs/STABILITY.md proves boundedness for any input, convergence to H* for
a stationary distribution when gain <= 1 / max varentropy over [T_min, T_max], and saturation at
T_min or T_max when H* is out of reach. Clipping u itself is the anti-windup: the integrator
never accumulates error it cannot act on.

Bands reconcile "be precise when sure, explore when unsure": below `entropy_floor` (model
entropy, T = 1) the step is sampled greedily and u is frozen; in the middle band T = exp(u)
holds H*; at the top T is capped at T_max.

The target is either fixed (`target_entropy`, one number for every text) or, for a row with
`track_base`, the running mean of the entropy its own base temperature T0 would give its
tokens so far, H*_n = mean over its middle-band steps i <= n of H(softmax(z_i / T0)). A fixed
H* calibrated on one kind of text moves every other kind: held at 1.6 nats (T = 0.7's mean on
news continuations), SmolLM2's instruct answers are sampled at 1.40 nats where T = 0.7 gives
them 1.32, and come out 1.06x as long (docs/PERF.md, "The controller's target"). The
tracking target keeps the level T0 gives each text and leaves the controller to narrow the
spread around it; on a stationary distribution H*_n = H(z / T0) and the controller converges
to T0 itself.
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
    track_base: jax.Array  # [B] bool: hold the running mean entropy at log_t_base instead
    log_t_base: jax.Array  # [B] log T0, the request's own temperature


@flax.struct.dataclass
class BaseEntropy:
    """Per-row running mean of H(z / T0) over middle-band steps: a tracking row's target."""

    mean: jax.Array  # [B] nats
    steps: jax.Array  # [B] float32, middle-band steps counted so far


@flax.struct.dataclass
class ControllerStep:
    """What one controller step decided. B = batch."""

    temperature: jax.Array  # [B] temperature sampled with this step (0 = greedy, floor band)
    sampled_entropy: jax.Array  # [B] entropy of the distribution actually sampled from
    log_temperature: jax.Array  # [B] controller state for the next step
    base: BaseEntropy  # the tracking target's running mean, this step counted


def no_base_entropy(rows_like: jax.Array) -> BaseEntropy:
    """A fresh running mean (no step counted) for rows shaped like `rows_like` [B]."""
    zeros = jnp.zeros_like(rows_like, dtype=jnp.float32)
    return BaseEntropy(mean=zeros, steps=zeros)


def tracked_target(
    logits: jax.Array, model_entropy: jax.Array, p: ControllerParams, base: BaseEntropy
) -> tuple[jax.Array, BaseEntropy]:
    """Each row's target [B] this step and the running mean with this step counted.

    A tracking row in the middle band adds H(z / T0) to its mean (one O(V) pass) and holds
    the mean; in the floor band the step is greedy and not counted. Other rows hold
    `target_entropy`."""
    counted = p.track_base & (model_entropy >= p.entropy_floor)
    steps = base.steps + counted.astype(jnp.float32)
    h_base = jax.lax.cond(  # only batches holding a counted tracking row pay the pass
        jnp.any(counted),
        lambda: exact_entropy(logits, jnp.exp(p.log_t_base)),
        lambda: jnp.zeros_like(model_entropy),
    )
    mean = jnp.where(counted, base.mean + (h_base - base.mean) / jnp.maximum(steps, 1.0), base.mean)
    target = jnp.where(p.track_base & (steps > 0), mean, p.target_entropy)
    return target, BaseEntropy(mean=mean, steps=steps)


def controller_step(
    logits: jax.Array,
    model_entropy: jax.Array,
    log_temperature: jax.Array,
    p: ControllerParams,
    iterations: int = 1,
    base: BaseEntropy | None = None,
) -> ControllerStep:
    """Apply the controller to one step's logits [B, V] (model_entropy [B] at T = 1).

    Starting from the state `log_temperature` [B], the control law is applied `iterations`
    times to this step's logits (each application measures H(z / T) and corrects u), and the
    step is sampled at the resulting temperature, which is also the state for the next step.
    One iteration is pure step-to-step feedback; more track a changing distribution within the
    token, at one O(V) entropy evaluation each. The stability results hold for the sequence of
    iterates whatever `iterations` is. Rows whose model entropy is below `entropy_floor` are
    greedy and keep their state. `base`: the tracking rows' running mean before this step
    (None: no row tracks, the H(z / T0) pass is skipped).
    """
    if base is None:
        target, base = p.target_entropy, no_base_entropy(model_entropy)
    else:
        target, base = tracked_target(logits, model_entropy, p, base)
    u = log_temperature
    for _ in range(iterations):
        error = target - exact_entropy(logits, jnp.exp(u))
        u = jnp.clip(
            u + jnp.clip(p.gain * error, -p.max_step, p.max_step), p.log_t_min, p.log_t_max
        )
    temperature = jnp.exp(u)
    sampled_entropy = exact_entropy(logits, temperature)
    in_floor = model_entropy < p.entropy_floor
    return ControllerStep(
        temperature=jnp.where(in_floor, 0.0, temperature),
        sampled_entropy=jnp.where(in_floor, 0.0, sampled_entropy),
        log_temperature=jnp.where(in_floor, log_temperature, u),
        base=base,
    )


def initial_log_temperature(params: ControllerParams, temperature: jax.Array) -> jax.Array:
    """The starting state: log of the request's temperature, clipped into [T_min, T_max]."""
    safe = jnp.log(jnp.maximum(temperature, 1e-6))
    return jnp.clip(safe, params.log_t_min, params.log_t_max)
