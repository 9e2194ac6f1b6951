"""The calibrated entropy signal, on the device: what pruning, the scheduler and drafting read.

A calibration (file.py) is a temperature T fitted to text (fit.py): the calibrated signal of a
row is the entropy of softmax(z / T) of the distribution it samples from, where the raw model
entropy is that of softmax(z). Sampling still draws from the raw logits (the sampler's own
temperature is the user's); only the signal the engine's levels steer by changes.

T rides in the decode state as an array, one value per row (rows over the mesh's data axis
like every other row field), never as a static: engines with and without a calibration, or
with different ones, run the same compiled programs. A row with T = 1 (every row when no
calibration is loaded) passes the raw entropy through unchanged, bit for bit, and a batch of
such rows skips the extra pass over the vocabulary at run time (a `lax.cond`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from etjax.entropy.estimators import exact_entropy


@flax.struct.dataclass
class CalibrationParams:
    """Per-row calibration of the entropy signal. B = batch."""

    temperature: jax.Array  # [B] float32 > 0; 1 = uncalibrated (the signal is the raw entropy)


def identity_params(rows: int, xp=jnp) -> CalibrationParams:
    """Uncalibrated rows: T = 1 for each of `rows`."""
    return CalibrationParams(temperature=xp.ones(rows, xp.float32))


def row_params(temperature: float) -> CalibrationParams:
    """The host value for one row inserted under a calibration of temperature T ([1])."""
    return CalibrationParams(temperature=np.full(1, temperature, np.float32))


def calibrated_entropy(logits: jax.Array, raw: jax.Array, params: CalibrationParams) -> jax.Array:
    """The entropy signal [B] of rows with logits [B, V] and raw model entropy `raw` [B]:
    `raw` itself where T = 1, else the entropy of softmax(logits / T)."""
    t = params.temperature
    calibrated = jax.lax.cond(jnp.any(t != 1.0), lambda: exact_entropy(logits, t), lambda: raw)
    return jnp.where(t == 1.0, raw, calibrated)
