"""The building blocks of a Llama-family decoder layer, as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.products import project


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back to `x.dtype`.

    Matches Hugging Face: normalise in float32, cast to the input dtype, then scale.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale * normed.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times a projection stored output-major, w [out, in] -> [..., out] (what
    `x @ w.T` computes, without transposing w; etjax/model/leaves.py says why this layout;
    products.py where it runs)."""
    return project(x, w)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate|up fused in one product
    (w_gate_up [2F, D], w_down [D, F])."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w_down)
