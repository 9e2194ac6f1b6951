"""The cost model: what producing one token of one sequence costs, in FLOPs and bytes read.

Entropic time per unit cost, d tau / d C, is only comparable across configurations if C is
counted the same way everywhere. etjax counts, for every forward pass of one token of one
sequence (decode step or prompt token):

  FLOPs = 2 * P_matmul + 4 * L * H * hd * K
  bytes = W / n + 2 * L * KVH * hd * s * K

P_matmul: parameters used in matrix products (all projections and the LM head); L layers, H
query heads, KVH KV heads, head dim hd, s bytes per cache element; K keys attended = the whole
pages the paged kernel reads for this sequence (ceil(positions / page_size) * page_size, or the
kept pages once attention is pruned), averaged over the layers: a sliding-window layer
(Gemma 3's local layers) reads at most the pages its window spans, pruned or not; W bytes of
weights as loaded (a matrix kept in 4-bit blocks counts its blocks), read once per forward pass
and shared by the n sequences in it. The scalar cost C of
d tau / d C is the bytes: decoding at the batch sizes that matter is bound by memory traffic,
and bytes are what pruning and batching change. FLOPs are reported alongside.

A mixture-of-experts layer (Qwen3-MoE, Mixtral) counts what a token runs: its router (D * E)
and its k experts of E (3 * D * M each), in P_matmul and in W alike; a token never reads the
other E - k experts. W is then the weights one token's pass reads, exact for a pass of one
sequence; a pass of n tokens reads the union of their experts, between k and min(E, n k) per
layer, which W / n undercounts for large batches. (On XLA:CPU the grouped products run every
expert, masked: etjax/model/experts.py; the model counts what the routing asks for, which is
what an accelerator runs.) A token that runs fewer experts (entropy-steered experts,
etjax/experts) counts that many: `token_cost(..., active_k=)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from etjax.model.config import ModelConfig
from etjax.model.weights import parameter_count


@dataclass(frozen=True)
class CostModel:
    """Per-token cost constants of one model (see the module docstring for the formula)."""

    matmul_flops_per_token: float
    attention_flops_per_key: float
    weight_bytes: float
    kv_bytes_per_key: float
    page_size: int
    # A page's key bounds, which pruned steps score (a float32 minimum and maximum per
    # dimension, layer and KV head): what a burst's estimate counts (etjax/engine/burst_cost.py).
    bound_bytes_per_page: float = 0.0
    # Sliding-window layers: how many of the model's layers, and the keys of the whole pages
    # a window can span (it starts mid-page), the most any of them reads.
    num_layers: int = 1
    num_local_layers: int = 0
    window_keys: float = 0.0
    # Mixture of experts: the k experts a token runs per sparse layer, and the FLOPs and
    # bytes of one of them summed over the sparse layers (0 for a dense model).
    experts_per_token: int = 0
    expert_flops: float = 0.0
    expert_bytes: float = 0.0

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        page_size: int,
        kv_dtype: str | None = None,
        resident_bytes: float | None = None,
        expert_resident_bytes: float | None = None,
    ) -> CostModel:
        """kv_dtype: the KV cache's ("float32", "bfloat16"); None: the model's dtype.
        resident_bytes: what the loaded weights hold (etjax/model/quantized.py's
        `weights_bytes`), for weights kept in blocks or another dtype than the model's; None:
        every parameter in the model's dtype. expert_resident_bytes: what the routed experts
        among them hold (etjax/model/weights.py `routed_expert_bytes`; None: the model's
        dtype), of which a token reads its k experts' share."""
        d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        attention = d * cfg.qkv_size + cfg.num_heads * cfg.head_dim * d
        sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
        expert = 3 * d * cfg.moe_intermediate_size  # one expert's gate, up and down
        routed = d * cfg.num_experts + cfg.num_experts_per_tok * expert  # router and k experts
        matmul_params = (
            cfg.num_layers * attention
            + (cfg.num_layers - sparse) * 3 * d * f
            + sparse * routed
            + d * v  # the LM head, tied or not
        )
        itemsize = cfg.jnp_dtype.itemsize
        all_experts = (
            sparse * cfg.num_experts * expert * itemsize
            if expert_resident_bytes is None
            else expert_resident_bytes
        )
        # One expert's bytes summed over the sparse layers, as held; a token leaves E - k unread.
        one_expert = all_experts / cfg.num_experts if cfg.num_experts else 0.0
        unread = (cfg.num_experts - cfg.num_experts_per_tok) * one_expert
        kv_itemsize = itemsize if kv_dtype is None else jnp.dtype(kv_dtype).itemsize
        return cls(
            matmul_flops_per_token=2.0 * matmul_params,
            attention_flops_per_key=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
            weight_bytes=float(
                (parameter_count(cfg) * itemsize if resident_bytes is None else resident_bytes)
                - unread
            ),
            kv_bytes_per_key=2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize,
            page_size=page_size,
            bound_bytes_per_page=2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
            num_layers=cfg.num_layers,
            num_local_layers=len(cfg.local_layers),
            window_keys=float((-(-cfg.attention_window // page_size) + 1) * page_size),
            experts_per_token=cfg.num_experts_per_tok,
            expert_flops=2.0 * sparse * expert,
            expert_bytes=float(one_expert),
        )

    def layer_keys(
        self, keys: jax.Array, context_keys: jax.Array | None = None, xp=jnp
    ) -> jax.Array:
        """Keys read per layer, averaged over the layers, by a token whose global layers read
        `keys` of a context of `context_keys` (default: `keys`, dense): its sliding-window
        layers read at most `window_keys` of the context. `xp`: numpy on the host."""
        if not self.num_local_layers:
            return keys
        context = keys if context_keys is None else context_keys
        local = xp.minimum(context, self.window_keys)
        num_global = self.num_layers - self.num_local_layers
        return (num_global * keys + self.num_local_layers * local) / self.num_layers

    def keys_read(self, positions: jax.Array, xp=jnp) -> jax.Array:
        """Keys a paged kernel reads to attend `positions` cached positions: whole pages
        (averaged over the layers, `layer_keys`)."""
        pages = (positions + self.page_size - 1) // self.page_size
        return self.layer_keys((pages * self.page_size).astype(np.float32), xp=xp)

    def prefill_cost(self, start: int, num_tokens: int, num_chunks: int) -> tuple[float, float]:
        """FLOPs and bytes (host floats) of a prompt chunk of `num_tokens` tokens from position
        `start`, in a step of `num_chunks` chunks that share one read of the weights."""
        positions = np.arange(start + 1, start + num_tokens + 1)
        keys = float(np.asarray(self.keys_read(positions, xp=np)).sum())
        flops = num_tokens * self.matmul_flops_per_token + self.attention_flops_per_key * keys
        return flops, self.weight_bytes / num_chunks + self.kv_bytes_per_key * keys

    def token_cost(
        self,
        keys: jax.Array,
        active: jax.Array,
        context_keys: jax.Array | None = None,
        active_k: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """FLOPs and bytes [B] of one forward step over rows `active` [B] whose global layers
        attend `keys` [B] of `context_keys` [B] (default: all of them; see `layer_keys`) and
        whose sparse layers run `active_k` [B] experts (default: k)."""
        keys = self.layer_keys(keys, context_keys)
        sharing = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
        flops = self.matmul_flops_per_token + self.attention_flops_per_key * keys
        weight_bytes = self.weight_bytes
        if active_k is not None:
            unrun = (self.experts_per_token - active_k).astype(jnp.float32)
            flops = flops - unrun * self.expert_flops
            weight_bytes = weight_bytes - unrun * self.expert_bytes
        nbytes = weight_bytes / sharing + self.kv_bytes_per_key * keys
        return jnp.where(active, flops, 0.0), jnp.where(active, nbytes, 0.0)
