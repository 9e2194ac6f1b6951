"""The weights pytree of a decoder, and the table of the leaves outside its layers.

Layers are a tuple of per-layer pytrees rather than arrays stacked on a layer axis: a slice of
a stacked array, static or indexed by a scan, is materialised as a copy before each matrix
product on XLA:CPU, doubling the bytes read per step. The forward pass still loops over layers
with a `lax.scan`, choosing each layer's buffers with `lax.switch` (etjax/model/transformer.py).

Projections are stored output-major (`[out, in]`, applied by `linear`) and fused where they
share an input: q|k|v in one matrix and gate|up in another, so each layer runs two large
products instead of five small ones.
Each leaf is described once, in a table (etjax/model/leaves.py): the model's own leaves below,
a layer's in its family's table (etjax/model/families/), whose pytree class is made from it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import flax.struct
import jax

from etjax.model.config import ModelConfig
from etjax.model.families import family
from etjax.model.leaves import HIDDEN, STORED, VOCAB, Leaf, Part, Table, axes_of
from etjax.model.quantized import INT8, abstract_quantized, weights_bytes


def _untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_word_embeddings


# The leaves every family shares, outside the layers.
MODEL_LEAVES: Table = {
    "embed": Leaf(
        (VOCAB, HIDDEN), (Part("model.embed_tokens.weight", "token_embd.weight"),), STORED
    ),
    "final_norm": Leaf(
        (HIDDEN,), (Part("model.norm.weight", "output_norm.weight"),), STORED, float32=True
    ),
    # Absent when tied: the logits then contract with `embed` (transformer.logits_from_hidden).
    "lm_head": Leaf((VOCAB, HIDDEN), (Part("lm_head.weight", "output.weight"),), present=_untied),
}


@flax.struct.dataclass
class Weights:
    """All weights of a decoder: the leaves of `MODEL_LEAVES` and the layers, each of its
    family's `layer_type`. V = vocabulary, D = hidden."""

    embed: jax.Array  # [V, D]
    layers: tuple[Any, ...]
    final_norm: jax.Array  # [D] float32
    lm_head: jax.Array | None  # [V, D], or None when tied to `embed`
    # Gemma 2's final soft cap (`ModelConfig.final_logit_softcapping`; 0: none), static. It is
    # part of what the head computes, so it travels with the head: every caller of
    # `logits_from_hidden` (the steps, speculation's verifier, the perplexity bench) applies it.
    logit_softcap: float = flax.struct.field(pytree_node=False, default=0.0)

    # Each array's dimensions by name, for the mesh placement (etjax/distributed/placement.py);
    # `layers` hold their own.
    AXES: ClassVar[dict[str, tuple[str | None, ...]]] = axes_of(MODEL_LEAVES)


def abstract_weights(cfg: ModelConfig, weights: str | None = None) -> Weights:
    """A `Weights` tree of `jax.ShapeDtypeStruct`s (None where a leaf is absent) describing a
    model with this config: orbax's restore target, and the truth shape checks compare with.
    `weights`: its matrices (`Leaf.is_matrix`) held as "int8" (abstract `QuantizedWeight`s,
    stacked experts too), "float32" or "bfloat16" (None: in cfg.dtype); what a planner counts
    for that option."""
    fam = family(cfg.architecture)

    def abstract(leaf: Leaf, layer: int | None = None):
        spec = leaf.abstract(cfg, layer)
        if spec is None or weights is None or not leaf.is_quantizable:
            return spec
        if weights == "int8":
            return abstract_quantized(INT8, spec.shape)
        if not leaf.is_matrix:  # stacked experts: floats of cfg.dtype unless int8
            return spec
        if weights in ("float32", "bfloat16"):
            return jax.ShapeDtypeStruct(spec.shape, weights)
        raise ValueError(f"weights={weights!r}; abstract weights know int8, float32, bfloat16")

    layers = tuple(
        fam.layer_type(**{name: abstract(leaf, i) for name, leaf in fam.layer.items()})
        for i in range(cfg.num_layers)
    )
    model = {name: abstract(leaf) for name, leaf in model_leaves(cfg).items()}
    return Weights(
        layers=layers,
        logit_softcap=cfg.final_logit_softcapping,
        **model,
    )


def model_leaves(cfg: ModelConfig) -> Table:
    """The leaves outside the layers of a model with this config: its family's, or the shared
    `MODEL_LEAVES`."""
    return family(cfg.architecture).model or MODEL_LEAVES


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of a model with this config (tied embeddings counted once)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_weights(cfg)))


def routed_expert_bytes(weights: Weights, cfg: ModelConfig) -> int:
    """Bytes the stacked routed experts of `weights` hold, every layer's, as they are held (in
    blocks, int8 or floats; a tree of arrays or of shapes): 0 for a model without them."""
    per_expert = [name for name, leaf in family(cfg.architecture).layer.items() if leaf.per_expert]
    return sum(
        weights_bytes(getattr(layer, name))
        for layer in weights.layers
        for name in per_expert
        if getattr(layer, name) is not None
    )
