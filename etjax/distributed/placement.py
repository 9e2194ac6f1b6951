"""Where every array of a decode lives on a (data, model) mesh, as `NamedSharding`s.

The weights and the KV cache name their arrays' dimensions (`AXES` of Weights, of each family's
layer class and of KVCache; the weights' come from their tables, etjax/model/leaves.py `Dim`);
this module maps names to mesh axes (`SPLITS`) and knows no field, so weights of another
layout or architecture place themselves by naming their dimensions. The resulting layout:

- **Weights** are split along the `model` axis the Megatron way: the fused q|k|v and gate|up
  projections by output unit, the attention output and down projections by input unit, the
  embedding table and LM head by vocabulary; norms are replicated. A mixture of experts'
  stacked experts are split by expert (expert parallelism: each device holds whole experts
  and computes the rows routed to them; the partial sums meet in an all-reduce), its router
  replicated. Each data group holds a full copy.
- **KV pages** are split by KV head over `model` when the head count divides, else by head
  dimension (SmolLM2 has 3 KV heads); the page axis is shared by all rows, so it is not split.
- **Decode state** rows are split over `data` and vocabulary-wide rows (logits, token counts)
  additionally over `model`: the logits stay vocabulary-sharded from the LM head through the
  entropy estimators and the sampler, which reduce them with partial log-sum-exps, maxima and
  top-k merges (topk.py) instead of gathering the vocabulary (tests/test_distributed.py).

A dimension is only split when the mesh axis divides it; otherwise that dimension is
replicated, which is always correct. XLA's SPMD partitioner inserts the collectives, so a
sharded program computes what the single-device one does, up to the order of float sums.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from etjax.distributed.mesh import DATA, MODEL
from etjax.model.quantized import QuantizedWeight

if TYPE_CHECKING:
    from etjax.cache.kv_cache import KVCache
    from etjax.model.weights import Weights

# The engine's per-row pytrees (etjax/runtime/state.py: `DecodeState`, `StepOutputs`), named by
# type variables: the runtime above places its state here, so nothing here names its types.
Rows = TypeVar("Rows")
Tree = TypeVar("Tree")

# The pytrees name their arrays' dimensions (`AXES` of Weights, layers and KVCache); each
# mesh axis splits the first of these names, in this order, that an array has and the axis
# divides. So KV pages split by KV head, or by head dimension where the heads do not divide.
SPLITS = {MODEL: ("vocab", "heads", "ffn", "experts", "kv_heads", "head_dim"), DATA: ("rows",)}


@dataclass(frozen=True)
class Placement:
    """The shardings of one mesh; hashable, so jitted programs can be cached per placement."""

    mesh: Mesh

    @property
    def data(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def model(self) -> int:
        return self.mesh.shape[MODEL]

    def sharding(self, shape: tuple[int, ...], axes: dict[int, str]) -> NamedSharding:
        """Split dimension d over mesh axis axes[d] where that axis divides it."""
        spec = [None] * len(shape)
        for dim, axis in axes.items():
            if shape[dim] % self.mesh.shape[axis] == 0:
                spec[dim] = axis
        return NamedSharding(self.mesh, P(*spec))

    def named_sharding(
        self, shape: tuple[int, ...], names: tuple[str | None, ...]
    ) -> NamedSharding:
        """The sharding of an array whose dimensions are called `names` (see `SPLITS`)."""
        axes = {}
        for axis, preferred in SPLITS.items():
            for name in preferred:
                dim = names.index(name) if name in names else None
                if dim is not None and shape[dim] % self.mesh.shape[axis] == 0:
                    axes[dim] = axis
                    break
        return self.sharding(shape, axes)

    def shardings(self, tree: Any) -> Any:
        """The sharding of every array of `tree`: dataclasses that declare `AXES`, tuples of
        them, and None for absent arrays."""
        if tree is None:
            return None
        if isinstance(tree, tuple):
            return tuple(self.shardings(t) for t in tree)
        axes = getattr(type(tree), "AXES", None)
        if axes is None:
            raise TypeError(f"{type(tree).__name__} does not name its dimensions (AXES)")
        fields = {}
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name)
            if not field.metadata.get("pytree_node", True):
                continue  # a static field (Weights.logit_softcap) is no array to place
            if field.name in axes and isinstance(value, QuantizedWeight):
                fields[field.name] = self._quantized(value, axes[field.name])
            elif field.name in axes and value is not None:
                fields[field.name] = self.named_sharding(value.shape, axes[field.name])
            else:
                fields[field.name] = self.shardings(value)
        return tree.replace(**fields)

    def _quantized(self, w: QuantizedWeight, names: tuple[str | None, ...]) -> QuantizedWeight:
        # A quantized matrix's arrays keep its rows on their first axis and its input's blocks
        # on their second, so each splits by the matrix's names where the mesh divides it (a
        # split of the input that does not fall on whole blocks cannot: scales do not divide).
        def sharding(array):
            if array is None:
                return None
            return self.named_sharding(array.shape, names)

        return w.replace(
            quants=sharding(w.quants), scales=sharding(w.scales), offsets=sharding(w.offsets)
        )

    def tracing(self):
        """A context for tracing a program on this mesh: code that adapts to the mesh (the
        sharded top-k, etjax/distributed/topk.py) sees it through `get_abstract_mesh`."""
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # Weights and KV cache: by the names they give their dimensions -------------------------

    def weights(self, weights: Weights) -> Weights:
        """The sharding of every weight (a `Weights` tree of `NamedSharding`s)."""
        return self.shardings(weights)

    def place_weights(self, weights: Weights) -> Weights:
        return jax.device_put(weights, self.weights(weights))

    def cache(self, cache: KVCache) -> KVCache:
        """Pages [L, N, KVH, ps, hd] split by KV head, or by head dimension when heads don't
        divide; the key bounds alike; the remembered mass [L, N, KVH] by head. (Folding the
        layers into the page axis, as a forward pass does, keeps these.)"""
        return self.shardings(cache)

    def place_cache(self, cache: KVCache) -> KVCache:
        return jax.device_put(cache, self.cache(cache))

    # Decode state: every leaf is per row ----------------------------------------------------

    def state(self, state: Rows, vocab_size: int) -> Rows:
        """Rows over `data`; [rows, vocab] arrays also over `model`; shared eos ids
        replicated."""

        def row_sharding(leaf: jax.Array) -> NamedSharding:
            axes = {0: DATA}
            if leaf.ndim == 2 and leaf.shape[1] == vocab_size:
                axes[1] = MODEL
            return self.sharding(leaf.shape, axes)

        shardings = jax.tree.map(row_sharding, state.replace(eos_ids=None))
        return shardings.replace(eos_ids=None if state.eos_ids is None else self.replicated)

    def outputs(self, outputs: Tree) -> Tree:
        """Per-step outputs [K, B]: rows over `data`."""
        return jax.tree.map(lambda leaf: self.sharding(leaf.shape, {1: DATA}), outputs)
