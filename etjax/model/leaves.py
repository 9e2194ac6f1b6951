"""The vocabulary of weight tables: one `Leaf` describes one weight leaf, once.

A leaf's row in its table (etjax/model/weights.py for the model's own leaves, a family's table
in etjax/model/families/ for a layer's) gives everything any part of etjax needs to know
about it: its shape and the names of its dimensions (`Dim`: a size read from the
`ModelConfig` and the name the mesh placement splits by), its dtype, when it is present, how
it is laid out, and the tensors of a Hugging Face or GGUF file it is built from (`Part`). The
pytree classes, the placement's `AXES`, the orbax restore targets, the shape checks and the
loaders' name maps are all read from the tables, so a weight is added or changed in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import flax.struct
import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig


@dataclass(frozen=True)
class Dim:
    """A dimension of a weight: its size from the config, and the name the mesh placement
    splits by (etjax/distributed/placement.py `SPLITS`; None: never split)."""

    size: Callable[[ModelConfig], int]
    mesh_name: str | None


HIDDEN = Dim(lambda c: c.hidden_size, None)  # D
VOCAB = Dim(lambda c: c.vocab_size, "vocab")  # V
HEAD_DIM = Dim(lambda c: c.head_dim, None)  # per-head norms (Gemma's q_norm, k_norm)
# Tensor parallelism splits q|k|v and gate|up by output unit, the attention output and down
# projections by input unit: attention heads and MLP units never mix across devices until the
# output projections' sums.
QKV = Dim(lambda c: c.qkv_size, "heads")  # Q = (heads + 2 kv_heads) * head_dim
ATTENTION = Dim(lambda c: c.num_heads * c.head_dim, "heads")  # A
FFN = Dim(lambda c: c.intermediate_size, "ffn")  # F
GATE_UP = Dim(lambda c: 2 * c.intermediate_size, "ffn")  # 2F
# Mixture of experts (E experts of width M). Expert parallelism splits the stacked experts by
# expert (each device holds E / n whole experts and runs their rows); the router's scores of
# all E experts stay whole on every device, which ranks them.
EXPERTS = Dim(lambda c: c.num_experts, "experts")  # E
ROUTED = Dim(lambda c: c.num_experts, None)  # E, in the router
EXPERT_GATE_UP = Dim(lambda c: 2 * c.moe_intermediate_size, None)  # 2M
EXPERT_FFN = Dim(lambda c: c.moe_intermediate_size, None)  # M


@dataclass(frozen=True)
class Part:
    """A tensor of a model file that a leaf is built from; "{i}" in a name is the layer index.

    `gguf_rope_heads` names the config field counting the heads of a q or k projection whose
    rows llama.cpp interleaved per head for its adjacent-pair RoPE (llama-architecture GGUF
    files only); the GGUF loader restores the Hugging Face half-split order etjax rotates in.
    `hf_offset` is added to the Hugging Face tensor: Gemma's norms scale by 1 + w, which
    llama.cpp stores as such and etjax keeps as the scale itself.
    `gguf` is None for a tensor no GGUF file holds (Qwen3-MoE's dense layers: llama.cpp's
    qwen3moe has routed experts in every layer). `expert` is set on the part of one expert
    (`of_expert`); a GGUF name without "{e}" is llama.cpp's tensor of all experts stacked,
    `[E, out, in]`, of which the part is the expert's slice.
    """

    hf: str
    gguf: str | None
    gguf_rope_heads: str | None = None
    hf_offset: float = 0.0
    expert: int | None = None

    def hf_name(self, layer: int | None) -> str:
        return self.hf.format(i=layer)

    def gguf_name(self, layer: int | None) -> str:
        if self.gguf is None:
            raise ValueError(f"no GGUF file holds the tensor of {self.hf!r}")
        return self.gguf.format(i=layer)

    def of_expert(self, expert: int) -> Part:
        """This part for expert `expert`: "{e}" in its names replaced by the index."""
        e = str(expert)
        gguf = None if self.gguf is None else self.gguf.replace("{e}", e)
        return dataclasses.replace(self, hf=self.hf.replace("{e}", e), gguf=gguf, expert=expert)


# Layouts. Products are stored output-major, `[out, in]` as Hugging Face and GGUF files keep
# them, and applied as `linear(x, w)` (etjax/model/layers.py); their parts are concatenated
# along the output axis (q|k|v, gate|up) so a layer runs two large products instead of five
# small ones; biases concatenate the same way. Why output-major: on XLA:CPU a product of a few
# rows runs faster against `[out, in]` weights (SmolLM2's products at 8 rows 10% faster, at 32
# rows 22%, no slower at 1 or 512; docs/PERF.md, "step_floor"). Norm scales and the embedding
# table are stored as the file has them.
OUTPUT_MAJOR = "output_major"
STORED = "stored"


def always(cfg: ModelConfig) -> bool:
    return True


def every_layer(cfg: ModelConfig, layer: int) -> bool:
    return True


@dataclass(frozen=True)
class Leaf:
    """One weight leaf: shape `[d.size(cfg) for d in dims]`, built from `parts`.

    `float32`: kept in float32 whatever the model dtype (norm scales: tiny, and RMSNorm runs in
    float32). `present(cfg)`: whether the model has the leaf; an absent leaf is None in the
    pytree. `layout`: OUTPUT_MAJOR (parts `[out_i, in]` give `[sum(out_i), in]`; 1-D parts
    give `[sum(out_i)]`) or STORED (one part, as it is). `in_layer(cfg, i)`: whether layer i
    has the leaf (a mixture of experts' dense layers have no router); it is None there.
    `per_expert`: the first dimension counts experts and every part's names hold "{e}": the
    parts of expert 0, then of expert 1, ... (`source_parts`) fill the leaf's rows in order,
    so expert e's parts `[out_i, in]` become its `[sum(out_i), in]` slice.
    """

    dims: tuple[Dim, ...]
    parts: tuple[Part, ...]
    layout: str = OUTPUT_MAJOR
    float32: bool = False
    present: Callable[[ModelConfig], bool] = always
    in_layer: Callable[[ModelConfig, int], bool] = every_layer
    per_expert: bool = False

    def __post_init__(self) -> None:
        if self.layout not in (OUTPUT_MAJOR, STORED):
            raise ValueError(f"Leaf.layout={self.layout!r}; allowed: {OUTPUT_MAJOR}, {STORED}")
        if self.layout == STORED and len(self.parts) != 1:
            raise ValueError("a STORED leaf is built from exactly one part")

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(d.size(cfg) for d in self.dims)

    def dtype(self, cfg: ModelConfig) -> jnp.dtype:
        return jnp.dtype("float32") if self.float32 else cfg.jnp_dtype

    @property
    def mesh_names(self) -> tuple[str | None, ...]:
        return tuple(d.mesh_name for d in self.dims)

    def has(self, cfg: ModelConfig, layer: int | None = None) -> bool:
        """Whether the model has this leaf (in `layer`; None: a leaf outside the layers)."""
        return self.present(cfg) and (layer is None or self.in_layer(cfg, layer))

    def source_parts(self, cfg: ModelConfig) -> tuple[Part, ...]:
        """The file tensors the leaf is built from, in row order (each expert's, per expert)."""
        if not self.per_expert:
            return self.parts
        return tuple(p.of_expert(e) for e in range(cfg.num_experts) for p in self.parts)

    @property
    def is_matrix(self) -> bool:
        """Whether the `weights` load option (etjax/model/quantized.py) decides how the leaf is
        held: a matrix (a projection, the embedding, the LM head), not a norm, a bias, a
        router or a mixture's stacked experts."""
        matrix = len(self.dims) == 2 and not self.float32
        return matrix and not self.per_expert and ROUTED not in self.dims

    @property
    def is_quantizable(self) -> bool:
        """Whether weights="int8" and "stored" hold the leaf quantized: a matrix
        (`is_matrix`), or a mixture's stacked experts [E, out, in] (each expert's weight in
        blocks of its own; "float32" and "bfloat16" leave them in the model's dtype)."""
        experts = self.per_expert and len(self.dims) == 3 and not self.float32
        return self.is_matrix or experts

    def abstract(self, cfg: ModelConfig, layer: int | None = None) -> jax.ShapeDtypeStruct | None:
        """The leaf's shape and dtype, or None where the model (`layer`) has no such leaf."""
        if not self.has(cfg, layer):
            return None
        return jax.ShapeDtypeStruct(self.shape(cfg), self.dtype(cfg))


Table = Mapping[str, Leaf]


def axes_of(table: Table) -> dict[str, tuple[str | None, ...]]:
    """The dimension names of every leaf of `table`, as the placement reads them (`AXES`)."""
    return {name: leaf.mesh_names for name, leaf in table.items()}


def pytree_class(name: str, table: Table, module: str) -> type:
    """A flax dataclass with one array field per leaf of `table` (None where absent), in the
    table's order, carrying the leaves' dimension names as `AXES`.

    The class is made from the table so that a family's layer is described once; its fields
    are plain attributes (`layer.wqkv`), so the forward pass reads it like a written class.
    """
    namespace = {
        "__annotations__": {field: jax.Array | None for field in table},
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"One layer's weights: {', '.join(table)} (the table in {module}).",
        "AXES": axes_of(table),
    }
    return flax.struct.dataclass(type(name, (), namespace))


def layer_part(
    hf: str, gguf: str | None, gguf_rope_heads: str | None = None, hf_offset: float = 0.0
) -> Part:
    """A `Part` of layer i: `hf` under "model.layers.{i}.", `gguf` under "blk.{i}."."""
    gguf_name = None if gguf is None else f"blk.{{i}}.{gguf}"
    return Part(f"model.layers.{{i}}.{hf}", gguf_name, gguf_rope_heads, hf_offset)
