"""Causal attention of new tokens over a paged KV cache."""

from pallas_kernels.paged_attention.xla_gather import paged_attention_xla

__all__ = ["paged_attention_xla"]
