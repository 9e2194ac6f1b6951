"""Test helpers that run etjax's forward pass directly, with a fresh cache per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import padded_batch_plan
from etjax.cache.kv_cache import init_kv_cache
from etjax.model.config import ModelConfig
from etjax.model.transformer import forward, logits_from_hidden
from etjax.model.weights import Weights


def full_logits(
    weights: Weights, cfg: ModelConfig, ids: np.ndarray, page_size: int = 16, last: int = 0
):
    """Logits [B, S, V] of a whole padded batch `ids` [B, S] run as one prefill; with `last`,
    only the last `last` positions' [B, last, V] (a large vocabulary's LM head over every
    position costs more than the model)."""
    b, s = ids.shape
    pages_per_row = -(-s // page_size)
    cache = init_kv_cache(cfg, 1 + b * pages_per_row, page_size)
    table = 1 + np.arange(b * pages_per_row, dtype=np.int32).reshape(b, pages_per_row)
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    plan, write_pages = padded_batch_plan(
        table, np.zeros(b, np.int32), np.full(b, s, np.int32), s, page_size, cfg.attention_window
    )
    hidden, _ = _forward(
        weights,
        cache,
        jnp.asarray(ids, jnp.int32).reshape(-1),
        jnp.asarray(positions).reshape(-1),
        write_pages,
        cfg,
        plan,
    )
    hidden = hidden.reshape(b, s, -1)[:, -last:] if last else hidden.reshape(b, s, -1)
    return np.asarray(logits_from_hidden(weights, hidden))


_forward = jax.jit(forward, static_argnames="cfg")
