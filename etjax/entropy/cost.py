"""The cost model: what producing one token of one sequence costs, in FLOPs and bytes read.

Entropic time per unit cost, d tau / d C, is only comparable across configurations if C is
counted the same way everywhere. etjax counts, for every forward pass of one token of one
sequence (decode step or prompt token):

  FLOPs = 2 * P_matmul + 4 * L * H * hd * K
  bytes = W / n + 2 * L * KVH * hd * s * K

P_matmul: parameters used in matrix products (all projections and the LM head); L layers, H
query heads, KVH KV heads, head dim hd, s bytes per cache element; K keys attended = the whole
pages the paged kernel reads for this sequence (ceil(positions / page_size) * page_size, or the
kept pages once attention is pruned); W bytes of weights, read once per forward pass and
shared by the n sequences in it. The scalar cost C of d tau / d C is the bytes: decoding at the
batch sizes that matter is bound by memory traffic, and bytes are what pruning and batching
change. FLOPs are reported alongside.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig


@dataclass(frozen=True)
class CostModel:
    """Per-token cost constants of one model (see the module docstring for the formula)."""

    matmul_flops_per_token: float
    attention_flops_per_key: float
    weight_bytes: float
    kv_bytes_per_key: float
    page_size: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int) -> CostModel:
        d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        per_layer = d * cfg.qkv_size + cfg.num_heads * cfg.head_dim * d + 3 * d * f
        matmul_params = cfg.num_layers * per_layer + d * v  # the LM head, tied or not
        itemsize = cfg.jnp_dtype.itemsize
        return cls(
            matmul_flops_per_token=2.0 * matmul_params,
            attention_flops_per_key=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
            weight_bytes=float(cfg.num_parameters * itemsize),
            kv_bytes_per_key=2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize,
            page_size=page_size,
        )

    def keys_read(self, positions: jax.Array) -> jax.Array:
        """Keys a paged kernel reads to attend `positions` cached positions: whole pages."""
        pages = (positions + self.page_size - 1) // self.page_size
        return (pages * self.page_size).astype(jnp.float32)

    def token_cost(self, keys: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
        """FLOPs and bytes [B] of one forward step over rows `active` [B] attending `keys` [B]."""
        sharing = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
        flops = self.matmul_flops_per_token + self.attention_flops_per_key * keys
        nbytes = self.weight_bytes / sharing + self.kv_bytes_per_key * keys
        return jnp.where(active, flops, 0.0), jnp.where(active, nbytes, 0.0)
