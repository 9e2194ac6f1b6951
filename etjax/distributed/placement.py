"""Where every array of a decode lives on a (data, model) mesh, as `NamedSharding`s.

- **Weights** are split along the `model` axis the Megatron way: the fused q|k|v and gate|up
  projections by output column, the attention output and down projections by input row, the
  embedding table and LM head by vocabulary; norms are replicated. Each data group holds a
  full copy.
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

from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from etjax.cache.kv_cache import KVCache
from etjax.distributed.mesh import DATA, MODEL
from etjax.model.weights import LayerWeights, Weights
from etjax.runtime.state import DecodeState, StepOutputs

# LayerWeights field -> the axis split over `model` (0 = rows / input, 1 = columns / output).
_LAYER_SPLIT = {"wqkv": 1, "bqkv": 0, "wo": 0, "w_gate_up": 1, "w_down": 0}


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

    def tracing(self):
        """A context for tracing a program on this mesh: code that adapts to the mesh (the
        sharded top-k, etjax/distributed/topk.py) sees it through `get_abstract_mesh`."""
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # Weights ------------------------------------------------------------------------------

    def weights(self, weights: Weights) -> Weights:
        """The sharding of every weight (a `Weights` tree of `NamedSharding`s)."""

        def layer(lw: LayerWeights) -> LayerWeights:
            fields = {}
            for name in ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                array = getattr(lw, name)
                if array is None:
                    fields[name] = None
                elif name in _LAYER_SPLIT:
                    fields[name] = self.sharding(array.shape, {_LAYER_SPLIT[name]: MODEL})
                else:
                    fields[name] = self.replicated
            return LayerWeights(**fields)

        return Weights(
            embed=self.sharding(weights.embed.shape, {0: MODEL}),
            layers=tuple(layer(lw) for lw in weights.layers),
            final_norm=self.replicated,
            lm_head=None
            if weights.lm_head is None
            else self.sharding(weights.lm_head.shape, {1: MODEL}),
        )

    def place_weights(self, weights: Weights) -> Weights:
        return jax.device_put(weights, self.weights(weights))

    # KV cache -----------------------------------------------------------------------------

    def _head_axes(self, num_kv_heads: int, head_dim_axis: int | None) -> dict[int, str]:
        if num_kv_heads % self.model == 0 or head_dim_axis is None:
            return {2: MODEL}
        return {head_dim_axis: MODEL}

    def cache(self, cache: KVCache) -> KVCache:
        """Pages [L, N, KVH, ps, hd] split by KV head, or by head dimension when heads don't
        divide; the key bounds [L, N, KVH, hd] alike; the remembered mass [L, N, KVH] by
        head. (Folding the layers into the page axis, as a forward pass does, keeps these.)"""
        heads = cache.k.shape[2]
        page = self.sharding(cache.k.shape, self._head_axes(heads, 4))
        bounds = self.sharding(cache.k_min.shape, self._head_axes(heads, 3))
        mass = self.sharding(cache.block_mass.shape, {2: MODEL})
        return KVCache(k=page, v=page, k_min=bounds, k_max=bounds, block_mass=mass)

    def place_cache(self, cache: KVCache) -> KVCache:
        return jax.device_put(cache, self.cache(cache))

    # Decode state -------------------------------------------------------------------------

    def state(self, state: DecodeState, vocab_size: int) -> DecodeState:
        """Rows over `data`; [rows, vocab] arrays also over `model`; shared eos ids
        replicated."""

        def row_sharding(leaf: jax.Array) -> NamedSharding:
            axes = {0: DATA}
            if leaf.ndim == 2 and leaf.shape[1] == vocab_size:
                axes[1] = MODEL
            return self.sharding(leaf.shape, axes)

        shardings = jax.tree.map(row_sharding, state.replace(eos_ids=None))
        return shardings.replace(eos_ids=None if state.eos_ids is None else self.replicated)

    def outputs(self, outputs: StepOutputs) -> StepOutputs:
        """Per-step outputs [K, B]: rows over `data`."""
        return jax.tree.map(lambda leaf: self.sharding(leaf.shape, {1: DATA}), outputs)
