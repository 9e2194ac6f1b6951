"""Translate a Hugging Face `config.json` into a `ModelConfig`, refusing what etjax can't run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from etjax.errors import ModelLoadError
from etjax.loaders.hf_rope import rope_scaling_of
from etjax.model.config import ModelConfig, RopeScaling
from etjax.model.families import hf_model_types


def read_hf_config(path: Path, dtype: str) -> ModelConfig:
    """Parse `path` (a config.json) into a `ModelConfig` with the given compute dtype."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: config.json not found") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return hf_config_to_model_config(raw, dtype, source=str(path))


def hf_config_to_model_config(raw: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    """Map config.json fields to a `ModelConfig`; errors name `source` and the field."""
    model_type = raw.get("model_type")
    families = hf_model_types()
    if model_type not in families:
        raise ModelLoadError(
            f"{source}: model_type={model_type!r} is not supported; allowed: {tuple(families)}"
        )

    def field(name: str, default: Any = ...) -> Any:
        if name in raw and raw[name] is not None:
            return raw[name]
        if default is ...:
            raise ModelLoadError(f"{source}: required field {name!r} is missing")
        return default

    architecture = families[model_type].name
    if field("mlp_bias", False):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
    num_heads = int(field("num_attention_heads"))
    hidden = int(field("hidden_size"))
    rope_params = raw.get("rope_parameters") or {}
    max_positions = int(field("max_position_embeddings", 4096))
    if architecture == "gemma3":
        return _gemma3_config(raw, field, dtype, source)
    if architecture == "gemma2":
        return _gemma2_config(raw, field, dtype, source)

    act = field("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    rope_theta = float(rope_params.get("rope_theta", field("rope_theta", 10000.0)))
    num_layers = int(field("num_hidden_layers"))
    head_dim = int(field("head_dim", hidden // num_heads))
    rotary = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if float(rotary) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor={rotary!r}; only 1.0 is supported")
    rope_scaling, max_positions = rope_scaling_of(raw, rope_params, head_dim, max_positions, source)
    windows: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    if architecture in ("qwen3", "qwen3_moe", "mixtral") and field("attention_bias", False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for {model_type}")
    if architecture == "qwen3":
        windows = _qwen3_windows(raw, num_layers, max_positions, source)
    elif architecture == "qwen3_moe":
        # transformers' Qwen3-MoE windows every layer when `use_sliding_window` (it has no
        # `max_window_layers` or `layer_types`).
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        windows = every_layer_windowed(window, num_layers, max_positions)
        experts = _moe_fields(raw, field, model_type, num_layers, source)
    elif architecture == "mixtral":
        windows = every_layer_windowed(raw.get("sliding_window"), num_layers, max_positions)
        experts = _moe_fields(raw, field, model_type, num_layers, source)
    elif architecture == "phi3":
        windows = every_layer_windowed(raw.get("sliding_window"), num_layers, max_positions)
    else:
        max_positions = min(max_positions, _sliding_window_limit(raw, model_type) or max_positions)

    return ModelConfig(
        vocab_size=int(field("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(field("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
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
    num_experts = int(raw.get("num_experts") or field("num_local_experts"))
    top_k = int(field("num_experts_per_tok"))
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={top_k}; must be 1..{num_experts} (the experts)"
        )
    if model_type == "mixtral":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(field("intermediate_size")),
            norm_topk_prob=True,
        )
    step = int(field("decoder_sparse_step", 1))
    only = [int(i) for i in field("mlp_only_layers", [])]
    if step < 1 or any(not 0 <= i < num_layers for i in only):
        raise ModelLoadError(
            f"{source}: decoder_sparse_step={step} must be at least 1 and mlp_only_layers="
            f"{only} list layers 0..{num_layers - 1}"
        )
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(field("moe_intermediate_size")),
        norm_topk_prob=bool(field("norm_topk_prob", False)),
        dense_mlp_layers=dense,
    )


def _gemma3_config(raw: dict, field, dtype: str, source: str) -> ModelConfig:
    # Gemma 3 text models: layers marked "sliding_attention" see the last `sliding_window`
    # positions and rotate with the local base; "full_attention" layers see everything.
    num_layers = int(field("num_hidden_layers"))
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
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each "
            f"of the {num_layers} layers"
        )
    # transformers 5 keeps one RoPE table per layer type; transformers 4 two fields. Gemma 3
    # 4B and larger slow their global layers' rotation linearly (factor 8; transformers 4
    # wrote it as `rope_scaling`); local layers are never scaled.
    rope = raw.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    kind = local.get("rope_type", "default")
    if kind != "default":
        raise ModelLoadError(
            f"{source}: rope_parameters.sliding_attention.rope_type={kind!r} is not "
            "supported; allowed: default"
        )
    scaling, name = full, "rope_parameters.full_attention"
    if full.get("rope_type", "default") == "default" and raw.get("rope_scaling"):
        scaling, name = raw["rope_scaling"], "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelLoadError(
            f"{source}: {name}.rope_type={kind!r} is not supported; allowed: default, linear"
        )
    rope_scaling = None
    if kind == "linear":
        rope_scaling = RopeScaling("linear", factor=float(scaling["factor"]))
    if field("attention_bias", False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for Gemma 3")
    num_heads = int(field("num_attention_heads"))
    hidden = int(field("hidden_size"))
    head_dim = int(field("head_dim", hidden // num_heads))
    return ModelConfig(
        vocab_size=int(field("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(field("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rope_theta=float(full.get("rope_theta", field("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(field("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(field("tie_word_embeddings", True)),
        dtype=dtype,
        architecture="gemma3",
        sliding_window=int(field("sliding_window")),
        local_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
        rope_local_theta=float(local.get("rope_theta", field("rope_local_base_freq", 10000.0))),
        query_pre_attn_scalar=float(field("query_pre_attn_scalar", head_dim)),
    )


def _gemma2_config(raw: dict, field, dtype: str, source: str) -> ModelConfig:
    # Gemma 2: every other layer (the first, third, ...) sees the last `sliding_window`
    # positions unless `layer_types` says otherwise; one RoPE base for all; soft caps on the
    # attention scores and the final logits (null: none).
    num_layers = int(field("num_hidden_layers"))
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
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ModelLoadError(
            f"{source}: rope_scaling type {kind!r} is not supported for Gemma 2; allowed: default"
        )
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each "
            f"of the {num_layers} layers"
        )
    num_heads = int(field("num_attention_heads"))
    hidden = int(field("hidden_size"))
    head_dim = int(field("head_dim", hidden // num_heads))
    max_positions = int(field("max_position_embeddings", 8192))
    window = raw.get("sliding_window")
    local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    windows = {}
    if window and local and int(window) < max_positions:
        windows = dict(sliding_window=int(window), local_layers=local)
    rope_theta = float(rope.get("rope_theta", field("rope_theta", 10000.0)))
    return ModelConfig(
        vocab_size=int(field("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(field("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        dtype=dtype,
        architecture="gemma2",
        rope_local_theta=rope_theta,
        query_pre_attn_scalar=float(field("query_pre_attn_scalar", head_dim)),
        attn_logit_softcapping=float(field("attn_logit_softcapping", 0.0)),
        final_logit_softcapping=float(field("final_logit_softcapping", 0.0)),
        **windows,
    )


def _qwen3_windows(raw: dict, num_layers: int, max_positions: int, source: str) -> dict:
    # Qwen3's sliding-window layers (off unless `use_sliding_window`) are the ones `layer_types`
    # marks, or else those from `max_window_layers` on, as transformers reads the config. A
    # window as long as the context never binds, and is dropped.
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if window and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each "
            f"of the {num_layers} layers"
        )
    local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if not local or not window or int(window) >= max_positions:
        return {}
    return dict(sliding_window=int(window), local_layers=local)


def every_layer_windowed(window: int | None, num_layers: int, max_positions: int) -> dict:
    """The `ModelConfig` fields of a model whose every layer sees the last `window` positions
    (Phi-3); none when it has no window or one as long as its context, which never binds."""
    if not window or int(window) >= max_positions:
        return {}
    return dict(sliding_window=int(window), local_layers=tuple(range(num_layers)))


def _sliding_window_limit(raw: dict, model_type: str) -> int | None:
    # etjax attends to the whole context. Within a sliding window that is exact, so a model with
    # one is served with its context capped at the window rather than silently approximated.
    window = raw.get("sliding_window")
    if window is None:
        return None
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return int(window)
