"""Read RoPE scaling from a GGUF file: the `RopeScaling` (etjax/model/config.py) that the Hugging
Face config the file was converted from gives (etjax/loaders/hf_rope.py), and the context
etjax serves with it.

What llama.cpp's converter (convert_hf_to_gguf.py) writes, and how it is read here:

- linear: `{arch}.rope.scaling.type` "linear" and `.factor`.
- yarn: type "yarn", `.factor`, `.original_context_length`, and where the Hugging Face config
  has them `.yarn_beta_fast`, `.yarn_beta_slow`, `.yarn_attn_factor` (its `attention_factor`)
  and `.yarn_ext_factor` (an `extrapolation_factor`, which transformers does not have; only 1,
  a full blend, is what etjax computes). `mscale`, `mscale_all_dim` and `truncate` are not
  written: the file means transformers' defaults (temperature 0.1 ln(factor) + 1, the band's
  ends rounded outwards), which are also what llama.cpp computes.
- longrope (Phi-3): no type key; `.original_context_length`, `.attn_factor` (the temperature)
  and the per-frequency factors as tensors `rope_factors_short.weight` and
  `rope_factors_long.weight`. etjax reads the short factors and serves the original context,
  as from the Hugging Face directory.
- llama3 (Llama 3.1 and later): no key; the per-frequency divisors as tensor
  `rope_freqs.weight`, which is what llama3's parameters compute. They are kept as
  `frequency_factors` of a llama3 scaling (the parameters themselves are not in the file).

Any other key or value (`.alpha`, `.yarn_log_multiplier`, another type, scaling on a family
whose Hugging Face config allows none) is refused by name with what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from etjax.errors import ModelLoadError
from etjax.gguf_file import GGUFFile
from etjax.model.config import RopeScaling

_SHORT, _LONG, _FREQS = (
    "rope_factors_short.weight",
    "rope_factors_long.weight",
    "rope_freqs.weight",
)
# The scaling each family's Hugging Face reader accepts (hf_config.py), so the GGUF reader
# accepts no more. Keys are etjax family names; the rest accept every type.
_FAMILY_TYPES = {"gemma2": ("none",), "gemma3": ("none", "linear")}
_TYPES = ("none", "linear", "yarn", "longrope", "llama3")
# Keys that say nothing a config holds: `finetuned` is informational, and Phi-3 files carry
# `original_context_length` whether or not they scale.
_IGNORED = ("finetuned",)


def gguf_rope_scaling(
    reader: GGUFFile, arch: str, family: str, head_dim: int, max_positions: int
) -> tuple[RopeScaling | None, int]:
    """The RoPE scaling of a GGUF file's `{arch}.rope.scaling.*` keys and factor tensors
    (None: none) and the context etjax serves with it, from `max_positions`
    ({arch}.context_length); ModelLoadError naming the key or tensor, its value and what is
    allowed for anything etjax cannot compute exactly."""
    prefix = f"{arch}.rope.scaling."
    keys = {k[len(prefix) :]: v for k, v in reader.fields.items() if k.startswith(prefix)}
    for key in _IGNORED:
        keys.pop(key, None)
    tensors = {t.name: t for t in reader.tensors if t.name in (_SHORT, _LONG, _FREQS)}
    stated = keys.pop("type", None)
    kind = stated or "none"
    if _FREQS in tensors:
        kind = _implied(reader, prefix, stated, "llama3", _FREQS)
    elif tensors:
        kind = _implied(reader, prefix, stated, "longrope", next(iter(tensors)))
    allowed = _FAMILY_TYPES.get(family, _TYPES)
    if kind not in allowed:
        what = f"{prefix}type={stated!r}" if stated else f"tensor {next(iter(tensors))!r}"
        raise ModelLoadError(
            f"{reader.path}: {what} ({kind} RoPE scaling) is not supported for {family}; "
            f"allowed: {allowed}"
        )

    def take(key: str, default: Any = ...) -> Any:
        if key in keys:
            return keys.pop(key)
        if default is ...:
            raise ModelLoadError(f"{reader.path}: {kind} RoPE scaling lacks {prefix}{key}")
        return default

    scaling, served = None, max_positions
    if kind == "none":
        keys.pop("original_context_length", None)
        for key in ("factor", "attn_factor"):
            _require(reader, prefix, key, take(key, 1.0), 1.0, "1.0 (no scaling)")
    elif kind == "linear":
        scaling = RopeScaling("linear", factor=float(take("factor")))
    elif kind == "yarn":
        original = _context(reader, prefix, take("original_context_length", max_positions))
        factor = float(take("factor", max_positions / original))
        default = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        _require(reader, prefix, "yarn_ext_factor", take("yarn_ext_factor", 1.0), 1.0, "1.0")
        scaling = RopeScaling(
            "yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(take("yarn_beta_fast", 32.0)),
            beta_slow=float(take("yarn_beta_slow", 1.0)),
            attention_factor=_float32_of(take("yarn_attn_factor", default), default),
        )
        served = max(max_positions, int(factor * original))
    elif kind == "longrope":
        original = _context(reader, prefix, take("original_context_length"))
        factor = float(take("factor", max_positions / original))
        default = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = _factors(reader, tensors, _SHORT, head_dim)
        if _LONG in tensors:
            _factors(reader, tensors, _LONG, head_dim)  # checked, unused: see hf_rope.py
        scaling = RopeScaling(
            "longrope",
            factor=factor,
            original_max_position_embeddings=original,
            frequency_factors=short,
            attention_factor=_float32_of(take("attn_factor", default), default),
        )
        served = min(max_positions, original)
    else:  # llama3: divisors 1 (short wavelengths) .. factor (long ones)
        keys.pop("original_context_length", None)
        divisors = _factors(reader, tensors, _FREQS, head_dim)
        scaling = RopeScaling("llama3", factor=max(divisors), frequency_factors=divisors)
    if keys:
        key, value = next(iter(keys.items()))
        raise ModelLoadError(
            f"{reader.path}: {prefix}{key}={value!r} is not supported with {kind} RoPE "
            f"scaling; allowed keys: {_ALLOWED_KEYS[kind]}"
        )
    return scaling, served


_ALLOWED_KEYS = {
    "none": ("type", "factor", "attn_factor", "original_context_length", "finetuned"),
    "linear": ("type", "factor", "finetuned"),
    "yarn": (
        "type",
        "factor",
        "original_context_length",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_attn_factor",
        "yarn_ext_factor",
        "finetuned",
    ),
    "longrope": ("type", "factor", "original_context_length", "attn_factor", "finetuned"),
    "llama3": ("original_context_length", "finetuned"),
}


def _implied(reader: GGUFFile, prefix: str, stated: str | None, kind: str, tensor: str) -> str:
    # A factor tensor says the scaling; a type key beside it must agree.
    if stated not in (None, kind):
        raise ModelLoadError(
            f"{reader.path}: {prefix}type={stated!r} beside tensor {tensor!r} (which means "
            f"{kind} RoPE scaling) is not supported; allowed: {kind!r} or no type"
        )
    return kind


def _require(reader: GGUFFile, prefix: str, key: str, value: Any, want: float, allowed: str):
    if float(value) != want:
        raise ModelLoadError(
            f"{reader.path}: {prefix}{key}={value!r} is not supported; allowed: {allowed}"
        )


def _context(reader: GGUFFile, prefix: str, value: Any) -> int:
    # The original context length: a divisor and a logarithm's argument, so at least 2.
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ModelLoadError(
            f"{reader.path}: {prefix}original_context_length={value!r}; must be an integer >= 2"
        )
    return value


def _float32_of(stored: Any, computed: float) -> float:
    # GGUF metadata holds float32: a stored value that is the default rounded is the default
    # the Hugging Face config meant (so the two loads give one config).
    return computed if np.float32(stored) == np.float32(computed) else float(stored)


def _factors(reader: GGUFFile, tensors: dict, name: str, head_dim: int) -> tuple[float, ...]:
    # A factor tensor's values, one per rotated pair.
    info = tensors[name]
    if info.dims != (head_dim // 2,) or info.data_dtype.kind != "f":
        raise ModelLoadError(
            f"{reader.path}: tensor {name!r} has shape {list(info.dims)} of "
            f"{info.tensor_type.name}; allowed: [{head_dim // 2}] (head_dim / 2) of F32, F16"
        )
    with open(reader.path, "rb") as file:
        file.seek(info.data_offset)
        values = np.fromfile(file, info.data_dtype, head_dim // 2)
    return tuple(float(v) for v in values)
