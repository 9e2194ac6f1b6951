"""`Family`: what etjax needs to know to run one decoder architecture."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from etjax.model.config import ModelConfig
from etjax.model.leaves import Table


@dataclass(frozen=True)
class Family:
    """A decoder architecture: its layer's weights (`layer`, a table of `Leaf`s, and
    `layer_type`, the pytree class made from it by `pytree_class`), what its layer computes
    around attention, and the names model files give it.

    The forward pass (etjax/model/transformer.py) is shared: embedding, RoPE, the paged
    attention and the final norm. Per layer it calls
      qkv_projection(layer, x [T, D], cfg) -> q|k|v [T, Q], before RoPE, and
      output_and_mlp(layer, x [T, D], heads [T, A], cfg) -> x [T, D], the residual stream
    after the attention output and the MLP; a family with routed experts also takes
    `active_k` [T], the experts each token runs (etjax/model/experts.py).
    """

    name: str  # ModelConfig.architecture
    layer: Table
    layer_type: type
    qkv_projection: Callable[[Any, jax.Array, ModelConfig], jax.Array]
    output_and_mlp: Callable[[Any, jax.Array, jax.Array, ModelConfig], jax.Array]
    hf_model_types: tuple[str, ...]  # config.json `model_type` values read as this family
    # GGUF `general.architecture` values read as this family: a file with routed experts
    # (`{arch}.expert_count` > 0) as the family that has them, one without as the one that
    # has none (llama.cpp writes Mixtral as `llama`).
    gguf_architectures: tuple[str, ...]
    # The leaves outside the layers, where the family's differ from `MODEL_LEAVES`
    # (etjax/model/weights.py) in more than names: None for the shared table.
    model: Table | None = None
    # Whether the embedding is scaled by sqrt(hidden_size) before the first layer (Gemma).
    scales_embedding: bool = False
    # Whether sliding-window layers (`ModelConfig.local_layers`) rotate with their own base,
    # `rope_local_theta`, and no RoPE scaling (Gemma 3); otherwise they rotate as every other
    # layer does (Qwen3's and Phi-3's windows only limit what a layer reads).
    local_rope: bool = False

    @property
    def routed_experts(self) -> bool:
        """Whether the family's layers can hold routed experts (a mixture of experts)."""
        return "router" in self.layer

    def __post_init__(self) -> None:
        fields = tuple(f.name for f in dataclasses.fields(self.layer_type))
        if fields != tuple(self.layer):
            raise ValueError(f"{self.name}: layer_type fields {fields} are not the table's")
