"""Translate a Hugging Face `config.json` into a `ModelConfig`, refusing what etjax can't run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from etjax.errors import EtjaxError, ModelLoadError, shown
from etjax.loaders.config_fields import ConfigFields
from etjax.loaders.hf_rope import rope_scaling_of
from etjax.model.config import ModelConfig, RopeScaling
from etjax.model.families import hf_model_types


def read_hf_config(path: Path, dtype: str) -> ModelConfig:
    """Parse `path` (a config.json) into a `ModelConfig` with the given compute dtype."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: config.json not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return hf_config_to_model_config(raw, dtype, source=str(path))


def hf_config_to_model_config(raw: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    """Map config.json fields to a `ModelConfig`; errors name `source` and the field."""
    try:
        return _model_config(raw, dtype, source)
    except ModelLoadError:
        raise
    except EtjaxError as e:  # ModelConfig's own checks, naming its field
        raise ModelLoadError(f"{source}: {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError, LookupError) as e:
        # A field of an unexpected kind that no check above named: still the file's fault.
        raise ModelLoadError(
            f"{source}: a field holds a value etjax cannot read ({type(e).__name__}: {e})"
        ) from None


def _model_config(raw: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    families = hf_model_types()
    if not isinstance(model_type, str) or model_type not in families:
        raise ModelLoadError(
            f"{source}: model_type={shown(model_type)} is not supported; allowed: {tuple(families)}"
        )
    field = ConfigFields(raw, source)
    architecture = families[model_type].name
    if field("mlp_bias", False):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
    num_heads = field.count("num_attention_heads")
    hidden = field.count("hidden_size")
    rope_params = field.table("rope_parameters")
    max_positions = field.count("max_position_embeddings", 4096)
    if architecture == "gemma3":
        return _gemma3_config(raw, field, dtype, source)
    if architecture == "gemma2":
        return _gemma2_config(raw, field, dtype, source)

    act = field("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    rope_theta = _rope_theta(field, rope_params, 10000.0)
    num_layers = field.count("num_hidden_layers")
    head_dim = field.count("head_dim", hidden // num_heads)
    rotary = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor={rotary!r}; only 1.0 is supported")
    rope_scaling, max_positions = rope_scaling_of(raw, rope_params, head_dim, max_positions, source)
    windows: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    if architecture in ("qwen3", "qwen3_moe", "mixtral") and field("attention_bias", False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for {model_type}")
    if architecture == "qwen3":
        windows = _qwen3_windows(field, num_layers, max_positions)
    elif architecture == "qwen3_moe":
        # transformers' Qwen3-MoE windows every layer when `use_sliding_window` (it has no
        # `max_window_layers` or `layer_types`).
        window = field.window() if raw.get("use_sliding_window", False) else None
        windows = every_layer_windowed(window, num_layers, max_positions)
        experts = _moe_fields(raw, field, model_type, num_layers, source)
    elif architecture == "mixtral":
        windows = every_layer_windowed(field.window(), num_layers, max_positions)
        experts = _moe_fields(raw, field, model_type, num_layers, source)
    elif architecture == "phi3":
        windows = every_layer_windowed(field.window(), num_layers, max_positions)
    else:
        limit = _sliding_window_limit(field, model_type)
        max_positions = min(max_positions, limit or max_positions)

    return ModelConfig(
        **_sizes(field, num_layers, num_heads, hidden, head_dim, routed=bool(experts)),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(field("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(field("attention_bias", False)),
        rope_scaling=rope_scaling,
        dtype=dtype,
        architecture=architecture,
        **windows,
        **experts,
    )


# Fields of other mixture-of-experts designs, refused by name wherever they are set.
_SHARED_EXPERT_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
)


def _moe_fields(raw: dict, field, model_type: str, num_layers: int, source: str) -> dict:
    # Qwen3-MoE: `num_experts` (transformers 5 writes `num_local_experts`) of width
    # `moe_intermediate_size`; a layer is dense where `mlp_only_layers` lists it or
    # (i + 1) % `decoder_sparse_step` != 0, as transformers builds it. Mixtral: every layer
    # sparse, experts of width `intermediate_size`, top-k weights always renormalised.
    for name in _SHARED_EXPERT_FIELDS:
        if raw.get(name):
            raise ModelLoadError(
                f"{source}: {name}={raw[name]!r} (shared experts) is not supported for {model_type}"
            )
    # The count of experts is the field the config holds (Qwen3-MoE's `num_experts`, else
    # `num_local_experts`), and an error names that one.
    count_name = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    num_experts = field.count(count_name)
    top_k = field.count("num_experts_per_tok")
    if top_k > num_experts:
        raise field.refuse(
            "num_experts_per_tok", top_k, f"1..{count_name}={num_experts} (the experts)"
        )
    if model_type == "mixtral":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=field.count("intermediate_size"),
            norm_topk_prob=True,
        )
    step = field.count("decoder_sparse_step", 1)
    only = field("mlp_only_layers", [])
    if not isinstance(only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in only
    ):
        raise field.refuse("mlp_only_layers", only, f"a list of layers 0..{num_layers - 1}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=field.count("moe_intermediate_size"),
        norm_topk_prob=bool(field("norm_topk_prob", False)),
        dense_mlp_layers=dense,
    )


def _gemma3_config(raw: dict, field, dtype: str, source: str) -> ModelConfig:
    # Gemma 3 text models: layers marked "sliding_attention" see the last `sliding_window`
    # positions and rotate with the local base; "full_attention" layers see everything.
    num_layers = field.count("num_hidden_layers")
    act = field("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"{source}: hidden_activation={act!r}; Gemma 3 supports 'gelu_pytorch_tanh'"
        )
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(name) is not None:
            raise ModelLoadError(f"{source}: {name}={raw[name]!r} is not supported (null only)")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        name = "_sliding_window_pattern" if "sliding_window_pattern" not in raw else ""
        pattern = field.count(name or "sliding_window_pattern", 6)
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    _check_layer_types(layer_types, num_layers, source)
    # transformers 5 keeps one RoPE table per layer type; transformers 4 two fields. Gemma 3
    # 4B and larger slow their global layers' rotation linearly (factor 8; transformers 4
    # wrote it as `rope_scaling`); local layers are never scaled.
    rope = field.table("rope_parameters")
    full, local = (
        ConfigFields(rope, source, "rope_parameters.").table(k)
        for k in ("full_attention", "sliding_attention")
    )
    kind = local.get("rope_type", "default")
    if kind != "default":
        raise ModelLoadError(
            f"{source}: rope_parameters.sliding_attention.rope_type={kind!r} is not "
            "supported; allowed: default"
        )
    scaling, name = full, "rope_parameters.full_attention"
    if full.get("rope_type", "default") == "default" and raw.get("rope_scaling"):
        scaling, name = field.table("rope_scaling"), "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelLoadError(
            f"{source}: {name}.rope_type={kind!r} is not supported; allowed: default, linear"
        )
    rope_scaling = None
    if kind == "linear":
        factor = ConfigFields(scaling, source, f"{name}.").number("factor", above=0)
        rope_scaling = RopeScaling("linear", factor=factor)
    if field("attention_bias", False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for Gemma 3")
    num_heads = field.count("num_attention_heads")
    hidden = field.count("hidden_size")
    head_dim = field.count("head_dim", hidden // num_heads)
    local_theta = ConfigFields(local, source, "rope_parameters.sliding_attention.")
    return ModelConfig(
        **_sizes(field, num_layers, num_heads, hidden, head_dim),
        rope_theta=_rope_theta(field, full, 1_000_000.0, "rope_parameters.full_attention."),
        rope_scaling=rope_scaling,
        max_position_embeddings=field.count("max_position_embeddings", 32768),
        tie_word_embeddings=bool(field("tie_word_embeddings", True)),
        dtype=dtype,
        architecture="gemma3",
        sliding_window=field.count("sliding_window"),
        local_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
        rope_local_theta=local_theta.number(
            "rope_theta", field.number("rope_local_base_freq", 10000.0)
        ),
        query_pre_attn_scalar=field.number("query_pre_attn_scalar", head_dim),
    )


def _gemma2_config(raw: dict, field, dtype: str, source: str) -> ModelConfig:
    # Gemma 2: every other layer (the first, third, ...) sees the last `sliding_window`
    # positions unless `layer_types` says otherwise; one RoPE base for all; soft caps on the
    # attention scores and the final logits (null: none).
    num_layers = field.count("num_hidden_layers")
    act = field("hidden_activation", field("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"{source}: hidden_activation={act!r}; Gemma 2 supports 'gelu_pytorch_tanh'"
        )
    if field("attention_bias", False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for Gemma 2")
    if not field("tie_word_embeddings", True):  # as every Gemma 2 is, and llama.cpp's
        raise ModelLoadError(
            f"{source}: tie_word_embeddings=false is not supported for Gemma 2 (tied only)"
        )
    rope = field.table("rope_scaling") or field.table("rope_parameters")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ModelLoadError(
            f"{source}: rope_scaling type {kind!r} is not supported for Gemma 2; allowed: default"
        )
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    _check_layer_types(layer_types, num_layers, source)
    num_heads = field.count("num_attention_heads")
    hidden = field.count("hidden_size")
    head_dim = field.count("head_dim", hidden // num_heads)
    max_positions = field.count("max_position_embeddings", 8192)
    window = field.window()
    local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    windows = {}
    if window and local and window < max_positions:
        windows = dict(sliding_window=window, local_layers=local)
    table = "rope_scaling." if field.table("rope_scaling") else "rope_parameters."
    rope_theta = _rope_theta(field, rope, 10000.0, table)
    return ModelConfig(
        **_sizes(field, num_layers, num_heads, hidden, head_dim),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        dtype=dtype,
        architecture="gemma2",
        rope_local_theta=rope_theta,
        query_pre_attn_scalar=field.number("query_pre_attn_scalar", head_dim),
        attn_logit_softcapping=field.number("attn_logit_softcapping", 0.0),
        final_logit_softcapping=field.number("final_logit_softcapping", 0.0),
        **windows,
    )


def _qwen3_windows(field: ConfigFields, num_layers: int, max_positions: int) -> dict:
    # Qwen3's sliding-window layers (off unless `use_sliding_window`) are the ones `layer_types`
    # marks, or else those from `max_window_layers` on, as transformers reads the config. A
    # window as long as the context never binds, and is dropped.
    window = field.window() if field("use_sliding_window", False) else None
    layer_types = field("layer_types", None)
    if layer_types is None:
        first = field.count("max_window_layers", num_layers, minimum=0)
        layer_types = [
            "sliding_attention" if window and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    _check_layer_types(layer_types, num_layers, field.source)
    local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if not local or not window or window >= max_positions:
        return {}
    return dict(sliding_window=window, local_layers=local)


def _check_layer_types(layer_types: Any, num_layers: int, source: str) -> None:
    kinds = {"sliding_attention", "full_attention"}
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or not all(isinstance(t, str) and t in kinds for t in layer_types)
    ):
        raise ModelLoadError(
            f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each "
            f"of the {num_layers} layers"
        )


def _rope_theta(
    field: ConfigFields, rope: dict, default: float, table: str = "rope_parameters."
) -> float:
    # transformers 5 writes the base in `rope_parameters` (or a layer type's table of it),
    # transformers 4 at the top level.
    if rope.get("rope_theta") is not None:
        return ConfigFields(rope, field.source, table).number("rope_theta", above=1)
    return field.number("rope_theta", default, above=1)


def _sizes(
    field: ConfigFields,
    num_layers: int,
    num_heads: int,
    hidden: int,
    head_dim: int,
    routed: bool = False,
) -> dict:
    # The sizes every family reads alike (ModelConfig's keywords); a model whose layers are
    # all routed experts may have no dense MLP width.
    return dict(
        vocab_size=field.count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=field.count("intermediate_size", minimum=0 if routed else 1),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_kv_heads(field, num_heads),
        head_dim=head_dim,
        rms_norm_eps=field.number("rms_norm_eps", 1e-6),
    )


def _kv_heads(field: ConfigFields, num_heads: int) -> int:
    kv_heads = field.count("num_key_value_heads", num_heads)
    if num_heads % kv_heads:
        raise field.refuse(
            "num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={num_heads}"
        )
    return kv_heads


def every_layer_windowed(window: int | None, num_layers: int, max_positions: int) -> dict:
    """The `ModelConfig` fields of a model whose every layer sees the last `window` positions
    (Phi-3); none when it has no window or one as long as its context, which never binds."""
    if not window or int(window) >= max_positions:
        return {}
    return dict(sliding_window=int(window), local_layers=tuple(range(num_layers)))


def _sliding_window_limit(field: ConfigFields, model_type: str) -> int | None:
    # etjax attends to the whole context. Within a sliding window that is exact, so a model with
    # one is served with its context capped at the window rather than silently approximated.
    if model_type == "qwen2" and not field("use_sliding_window", False):
        return None
    return field.window()
