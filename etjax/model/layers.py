"""The building blocks of a Llama-family decoder layer, as pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.products import project


def mean_square(x32: jax.Array) -> jax.Array:
    """The mean of x32's squares over the last axis [..., 1], summed in halves (the upper
    half added to the lower, again and again): element-wise additions, so a row's sum has
    the same bits whatever the rows beside it. XLA:CPU's reduction does not: it summed a
    row of 576 in one order among 8 rows or more and in another among fewer, so a verifying
    step of 8 rows normed a position differently from a burst's single row (docs/PERF.md,
    "Int8 rows"), and with rows rounded to int8 such a last-bit difference can cross a
    rounding step and change a token."""
    squares = x32 * x32
    width = squares.shape[-1]
    while width > 1:
        half = (width + 1) // 2
        upper = squares[..., half:width]
        if upper.shape[-1] < half:  # an odd width: the middle value has no partner
            pad = [(0, 0)] * (squares.ndim - 1) + [(0, half - upper.shape[-1])]
            upper = jnp.pad(upper, pad)
        squares = squares[..., :half] + upper
        width = half
    return squares / x32.shape[-1]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back to `x.dtype`.

    Matches Hugging Face: normalise in float32, cast to the input dtype, then scale.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(mean_square(x32) + eps)
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
