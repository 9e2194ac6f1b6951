"""Rotary position embedding: each config's rotation frequencies, RoPE scaling included
(`RopeScaling`, etjax/model/config.py), and the rotation of query and key heads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig, RopeScaling


def rope_inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    """Per-pair rotation frequencies [head_dim // 2], scaled as `cfg.rope_scaling` says."""
    exponents = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3" and not s.frequency_factors:
        return _llama3_scale(inv_freq, s)
    if s.rope_type == "yarn":
        return _yarn_scale(inv_freq, s, cfg.rope_theta, cfg.head_dim)
    # longrope, or llama3 as a GGUF file holds it (its divisors per frequency)
    return inv_freq / jnp.asarray(s.frequency_factors, jnp.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What the cosines and sines are multiplied by (yarn's and longrope's temperature)."""
    return 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_factor


def _llama3_scale(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones are kept, and the
    # band between is interpolated smoothly, as in Llama 3.1.
    wavelength = 2 * jnp.pi / inv_freq
    low_freq_wavelength = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelength = s.original_max_position_embeddings / s.high_freq_factor
    scaled = jnp.where(wavelength > low_freq_wavelength, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return jnp.where(in_band, interpolated, scaled)


def _yarn_scale(inv_freq: jax.Array, s: RopeScaling, base: float, dim: int) -> jax.Array:
    # YaRN: pairs that turn more than `beta_fast` times over the original context keep their
    # frequency (they already saw every angle in training), pairs turning fewer than
    # `beta_slow` times are slowed by `factor` (interpolated), and the pairs between blend
    # linearly. The band's ends are pair indices, found from the rotation counts.
    def pair_index(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a band of one pair: a step rather than a division by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: jax.Array | float = 1.0
) -> jax.Array:
    """Rotate query or key heads by their positions (Hugging Face half-split layout).

    x: [..., S, heads, head_dim]; positions: [..., S] int; `scale` multiplies the cosines and
    sines (`rope_attention_factor`). Returns the same shape and dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, hd/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    if not (isinstance(scale, float) and scale == 1.0):
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
