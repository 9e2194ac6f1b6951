"""Read RoPE scaling from a Hugging Face config.json: the `RopeScaling` of each type etjax
computes (etjax/model/config.py, etjax/model/rope.py), with transformers' defaults, and the
context it serves."""

from __future__ import annotations

import math
from typing import Any

from etjax.errors import ModelLoadError
from etjax.loaders.config_fields import ConfigFields
from etjax.model.config import ROPE_TYPES, RopeScaling


def rope_scaling_of(
    raw: dict[str, Any], rope_params: dict, head_dim: int, max_positions: int, source: str
) -> tuple[RopeScaling | None, int]:
    """The RoPE scaling a config.json asks for (None: none) and the context etjax serves with
    it, from `max_positions` (max_position_embeddings); ModelLoadError naming `source`, the
    field and the allowed values for a type or a field etjax cannot read. `rope_params` is
    the config's `rope_parameters` (transformers 5), where transformers 4 wrote
    `rope_scaling`."""
    fields = ConfigFields(raw, source)
    table = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    scaling = fields.table("rope_scaling") or rope_params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "su" or (rope_type == "yarn" and raw.get("model_type") == "phi3"):
        rope_type = "longrope"  # Phi-3's older names for it, as transformers reads them
    if rope_type == "default":
        return None, max_positions
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; allowed: "
            f"{('default', *ROPE_TYPES)}"
        )

    value = ConfigFields(scaling, source, f"{table}.")  # errors name the field in its table
    # The context the model was trained on (in the scaling's table, or at the top level as
    # Phi-3 writes it; absent or 0: max_position_embeddings), a logarithm's argument and a
    # divisor below.
    name = "original_max_position_embeddings"
    where = value if scaling.get(name) is not None else fields
    original = where.count(name, 0, minimum=0) or max_positions
    if original < 2:
        raise where.refuse(name, original, "an integer >= 2")
    if rope_type == "linear":
        return RopeScaling("linear", factor=value.number("factor", above=0)), max_positions
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor=value.number("factor", above=0),
            low_freq_factor=value.number("low_freq_factor", above=0),
            high_freq_factor=value.number("high_freq_factor", above=0),
            original_max_position_embeddings=value.count(name, minimum=2),
        ), max_positions
    if rope_type == "yarn":
        factor = value.number("factor", max_positions / original, above=0)
        mscale = value.number("mscale", 0.0)
        mscale_all_dim = value.number("mscale_all_dim", 0.0)
        if mscale and mscale_all_dim:
            default_attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            default_attention = _yarn_mscale(factor, 1.0)
        yarn = RopeScaling(
            "yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=value.number("beta_fast", 32.0, above=0),
            beta_slow=value.number("beta_slow", 1.0, above=0),
            truncate=bool(value("truncate", True)),
            attention_factor=value.number("attention_factor", default_attention, above=0),
        )
        # The context the scaling stretches the original one to (Qwen's long-context configs
        # keep the original in max_position_embeddings).
        return yarn, max(max_positions, int(factor * original))
    # longrope: the short factors hold up to the original context; past it transformers
    # switches every position of the sequence to the long factors, which would rotate the
    # cached keys anew. etjax serves the original context exactly instead of approximating.
    short = value.numbers("short_factor", above=0)
    if len(short) != head_dim // 2:
        raise ModelLoadError(
            f"{source}: longrope short_factor has {len(short)} entries; head_dim {head_dim} "
            f"needs {head_dim // 2}"
        )
    factor = value.number("factor", max_positions / original, above=0)
    default_attention = (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    )
    longrope = RopeScaling(
        "longrope",
        factor=factor,
        original_max_position_embeddings=original,
        frequency_factors=short,
        attention_factor=value.number("attention_factor", default_attention, above=0),
    )
    return longrope, min(max_positions, original)


def _yarn_mscale(factor: float, mscale: float) -> float:
    # YaRN's attention temperature for a context stretched `factor` times.
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
