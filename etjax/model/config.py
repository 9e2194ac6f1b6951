"""Model configuration: the hyper-parameters of a decoder, frozen and hashable.

A `ModelConfig` is passed to jitted functions as a static argument, so it must be hashable and
must never hold arrays.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import jax.numpy as jnp

from etjax.errors import FieldError

SUPPORTED_DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)


def resolve_dtype(dtype: str, platform: str | None = None) -> str:
    """ "auto" is bfloat16 on an accelerator (a model twice the size fits, and TPU and GPU
    matrix units run bfloat16 natively) and float32 on a CPU (which has no fast bfloat16
    arithmetic); any other value is returned as it is."""
    if dtype != "auto":
        return dtype
    if platform is None:
        import jax

        platform = jax.default_backend()
    return "float32" if platform == "cpu" else "bfloat16"


ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")

# The sizes every model has, each an integer >= 1.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)
# Numbers that may be 0 (no soft cap; the usual query scale) but never negative: an epsilon
# under a square root, a scale under one, a cap that divides.
_NON_NEGATIVE = (
    "rms_norm_eps",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise FieldError(name, value, f"an integer >= {minimum}")


def _positive_number(name: str, value: object) -> None:
    if not _is_number(value) or not value > 0:
        raise FieldError(name, value, "a finite number > 0")


def _number_at_least_0(name: str, value: object) -> None:
    if not _is_number(value) or value < 0:
        raise FieldError(name, value, "a finite number >= 0")


@dataclass(frozen=True)
class RopeScaling:
    """How a model's RoPE frequencies are scaled (config.json `rope_scaling`, in transformers 5
    `rope_parameters`): `rope_type` is one of `ROPE_TYPES`, each reading the fields marked for
    it (etjax/model/rope.py computes them).

    - linear: every frequency divided by `factor`.
    - llama3 (Llama 3.1): long wavelengths slowed by `factor`, short ones kept, the band
      between (`low_freq_factor`, `high_freq_factor` of `original_max_position_embeddings`)
      interpolated. Read from a GGUF file, which holds what those parameters compute and not
      the parameters, it is `frequency_factors` instead: frequency i divided by the i-th.
    - yarn: frequencies blended between `factor`-slowed and unchanged over the band of
      rotation counts `beta_slow`..`beta_fast` within `original_max_position_embeddings`.
    - longrope (Phi-3): frequency i divided by `frequency_factors[i]`; etjax reads the short
      factors and serves contexts up to `original_max_position_embeddings`, where they hold.
    `attention_factor` (yarn, longrope) multiplies the cosines and sines, so queries and keys.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    frequency_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type={self.rope_type!r}; allowed: {ROPE_TYPES}")
        # Each divides a frequency or is a logarithm's argument (etjax/model/rope.py): zero or
        # a negative would give infinite or NaN rotations, not an error.
        _positive_number("rope_scaling.factor", self.factor)
        _positive_number("rope_scaling.attention_factor", self.attention_factor)
        for i, f in enumerate(self.frequency_factors):
            _positive_number(f"rope_scaling.frequency_factors[{i}]", f)
        if self.rope_type == "yarn" or (self.rope_type == "llama3" and not self.frequency_factors):
            _count(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
            )
        if self.rope_type == "yarn":
            _positive_number("rope_scaling.beta_fast", self.beta_fast)
            _positive_number("rope_scaling.beta_slow", self.beta_slow)
        if self.rope_type == "llama3" and not self.frequency_factors:
            _positive_number("rope_scaling.low_freq_factor", self.low_freq_factor)
            if not self.high_freq_factor > self.low_freq_factor:  # the band's width divides
                raise FieldError(
                    "rope_scaling.high_freq_factor",
                    self.high_freq_factor,
                    f"greater than low_freq_factor={self.low_freq_factor}",
                )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM, Phi-3, Gemma 2/3,
    Qwen3-MoE, Mixtral).

    `architecture` names its family in etjax/model/families/ (its weight leaves and what its
    layer computes). `dtype` is the dtype of weights, activations and the KV cache; norms,
    softmax and logits are always accumulated in float32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 adds a bias to the q, k and v projections.
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"
    architecture: str = "llama"
    # Sliding-window attention (Gemma 3): the layers in `local_layers` see only the last
    # `sliding_window` positions and rotate with base `rope_local_theta`; the others see the
    # whole context with `rope_theta`.
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float = 10000.0
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (0: head_dim, the usual).
    query_pre_attn_scalar: float = 0.0
    # Gemma 2's soft caps: attention scores s and final logits z become c * tanh(s / c) with
    # their own c (0: none).
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Mixture of experts (Qwen3-MoE, Mixtral; 0 experts: a dense model): each token's MLP is
    # the weighted sum of the `num_experts_per_tok` experts (each a SwiGLU of width
    # `moe_intermediate_size`) its router ranks highest by softmax probability, weighted by
    # those probabilities, renormalised to sum to 1 when `norm_topk_prob`. The layers in
    # `dense_mlp_layers` have one dense MLP of `intermediate_size` instead (Qwen3-MoE's
    # `mlp_only_layers` and `decoder_sparse_step`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # FieldError (a ValueError) naming the field, the value and what is allowed: a loader
        # adds the file. Sizes divide (heads into groups, hidden into heads) or size arrays,
        # so a zero or a negative is refused here rather than met as a ZeroDivisionError or
        # a NaN inside the model.
        if self.dtype not in SUPPORTED_DTYPES:
            raise FieldError("ModelConfig.dtype", self.dtype, f"one of {SUPPORTED_DTYPES}")
        for name in _SIZES:
            _count(name, getattr(self, name))
        if self.head_dim % 2:  # RoPE rotates pairs of the head's dimensions
            raise FieldError("head_dim", self.head_dim, "an even integer (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise FieldError(
                "num_heads", self.num_heads, f"a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts == 0 or self.dense_mlp_layers:  # some layer has the dense MLP
            _count("intermediate_size", self.intermediate_size)
        for name in ("rope_theta", "rope_local_theta"):  # a base: theta ** (-2i / d) must fall
            value = getattr(self, name)
            if not _is_number(value) or not value > 1:
                raise FieldError(name, value, "a finite number > 1 (the RoPE base)")
        for name in _NON_NEGATIVE:
            _number_at_least_0(name, getattr(self, name))
        _count("sliding_window", self.sliding_window, minimum=0)
        if self.local_layers and self.sliding_window <= 0:
            raise FieldError(
                "sliding_window", self.sliding_window, f"> 0 for local_layers={self.local_layers}"
            )
        if any(not 0 <= i < self.num_layers for i in self.local_layers):
            raise FieldError("local_layers", self.local_layers, f"layers 0..{self.num_layers - 1}")
        _count("num_experts", self.num_experts, minimum=0)
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise FieldError(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    f"1..num_experts={self.num_experts}",
                )
            _count("moe_intermediate_size", self.moe_intermediate_size)
        if any(not 0 <= i < self.num_layers for i in self.dense_mlp_layers):
            raise FieldError(
                "dense_mlp_layers", self.dense_mlp_layers, f"layers 0..{self.num_layers - 1}"
            )

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def attention_window(self) -> int:
        """The sliding window of the model's local layers, 0 when it has none: what the
        attention plans list key tiles for (etjax/attention/plan.py)."""
        return self.sliding_window if self.local_layers else 0

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Width of the fused q|k|v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed experts (a mixture-of-experts layer)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=dtype)
