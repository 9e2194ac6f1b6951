"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k head norms, no biases)
and, in place of the dense MLP, routed experts (etjax/model/experts.py): a softmax router
over E experts, the top k of each token run, their weights renormalised where the config says
so (`norm_topk_prob`). No shared expert. Layers listed in `ModelConfig.dense_mlp_layers`
(the config's `mlp_only_layers`, or off the `decoder_sparse_step`) keep Qwen3's dense MLP and
have no router or experts; the others have no dense MLP.

llama.cpp's `qwen3moe` GGUF files store a layer's experts as one tensor per projection with
the experts stacked, `[E, out, in]` (each expert's Hugging Face matrix as it is; q and k rows
unpermuted, as Qwen3's), and have routed experts in every layer: the dense layers' tensors
have no GGUF names (etjax/loaders/gguf_weights.py reads the rest).
"""

from __future__ import annotations

import dataclasses

import jax

from etjax.model.config import ModelConfig
from etjax.model.experts import routed_experts
from etjax.model.families import qwen3
from etjax.model.families.family import Family
from etjax.model.layers import linear, rms_norm, swiglu_mlp
from etjax.model.leaves import (
    EXPERT_FFN,
    EXPERT_GATE_UP,
    EXPERTS,
    HIDDEN,
    ROUTED,
    Leaf,
    Table,
    layer_part,
    pytree_class,
)

DENSE_MLP = ("w_gate_up", "w_down")


def _sparse(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_sparse_layer(layer)


def _dense(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.is_sparse_layer(layer)


def expert_leaves(router: str, gate: str, up: str, down: str) -> Table:
    """The leaves of a sparse layer's MLP, from the Hugging Face names of its router and of
    expert "{e}"'s three projections (each under "model.layers.{i}."); their GGUF tensors
    are llama.cpp's, each expert a slice of its projection's stacked tensor."""

    def expert_part(hf: str, gguf: str):
        return layer_part(hf, f"{gguf}.weight")

    return {
        "router": Leaf(
            (ROUTED, HIDDEN), (layer_part(router, "ffn_gate_inp.weight"),), in_layer=_sparse
        ),
        "experts_gate_up": Leaf(  # [E, 2M, D]: expert e's rows gate | up
            (EXPERTS, EXPERT_GATE_UP, HIDDEN),
            (expert_part(gate, "ffn_gate_exps"), expert_part(up, "ffn_up_exps")),
            in_layer=_sparse,
            per_expert=True,
        ),
        "experts_down": Leaf(  # [E, D, M]
            (EXPERTS, HIDDEN, EXPERT_FFN),
            (expert_part(down, "ffn_down_exps"),),
            in_layer=_sparse,
            per_expert=True,
        ),
    }


def moe_output_and_mlp(
    layer,
    x: jax.Array,
    heads: jax.Array,
    cfg: ModelConfig,
    active_k: jax.Array | None = None,
) -> jax.Array:
    """x [T, D], heads [T, A] -> x [T, D]: add the attention output, then the normed stream's
    routed experts (a sparse layer) or dense SwiGLU MLP (a layer without a router).
    active_k: [T] int32 experts each token runs, 1..k (None: k; etjax/model/experts.py)."""
    x = x + linear(heads, layer.wo)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    if layer.router is None:
        return x + swiglu_mlp(h, layer.w_gate_up, layer.w_down)
    mlp = routed_experts(
        h,
        layer.router,
        layer.experts_gate_up,
        layer.experts_down,
        cfg.num_experts_per_tok,
        cfg.norm_topk_prob,
        active_k,
    )
    return x + mlp


def _dense_only(leaf: Leaf) -> Leaf:
    # A dense layer's MLP: never in a GGUF file (llama.cpp's converter cannot name it).
    parts = tuple(dataclasses.replace(p, gguf=None) for p in leaf.parts)
    return dataclasses.replace(leaf, in_layer=_dense, parts=parts)


def _layer_table() -> Table:
    table = {
        name: _dense_only(leaf) if name in DENSE_MLP else leaf for name, leaf in qwen3.LAYER.items()
    }
    experts = expert_leaves(
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    )
    return {**table, **experts}


LAYER = _layer_table()
Qwen3MoeLayer = pytree_class("Qwen3MoeLayer", LAYER, __name__)

QWEN3_MOE = Family(
    name="qwen3_moe",
    layer=LAYER,
    layer_type=Qwen3MoeLayer,
    qkv_projection=qwen3.qkv_projection,
    output_and_mlp=moe_output_and_mlp,
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
)
