"""The building blocks of a Llama-family decoder layer, as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.config import Llama3RopeScaling, ModelConfig


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back to `x.dtype`.

    Matches Hugging Face: normalise in float32, cast to the input dtype, then scale.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale * normed.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    """Per-pair rotation frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    exponents = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: jax.Array, s: Llama3RopeScaling) -> jax.Array:
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate query or key heads by their positions (Hugging Face half-split layout).

    x: [..., S, heads, head_dim]; positions: [..., S] int. Returns the same shape and dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, hd/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times a projection stored output-major, w [out, in] -> [..., out] (what
    `x @ w.T` computes, without transposing w; etjax/model/leaves.py says why this layout)."""
    return jnp.einsum("...i,oi->...o", x, w)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate|up fused in one product
    (w_gate_up [2F, D], w_down [D, F])."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w_down)
