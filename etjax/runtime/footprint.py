"""What an engine's sizes cost in device memory, checked before anything is allocated.

A setting like `page_size=10**6` or `max_batch_size=10**6` would otherwise get the process
killed for memory, or end in a raw RESOURCE_EXHAUSTED from XLA. `check_fits` estimates the
KV pool and the resident row store from the settings and refuses, naming the settings and what
they need, when that exceeds the memory the device has free.
"""

from __future__ import annotations

from pathlib import Path

import jax

from etjax.cache.kv_cache import kv_cache_bytes
from etjax.errors import ConfigError
from etjax.model.config import ModelConfig

_GIB = 2**30


def engine_bytes(
    cfg: ModelConfig, num_pages: int, page_size: int, rows: int, kv_dtype: str | None = None
) -> dict[str, int]:
    """Device bytes of the KV pool (pages of `kv_dtype`, None: the model's, plus the per-page
    key bounds and block mass) and of the row store (logits, output counts and prompt mask per
    row: three [rows, V] arrays)."""
    bounds = num_pages * cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim + 1) * 4
    return {
        "kv_cache": kv_cache_bytes(cfg, num_pages, page_size, kv_dtype) + bounds,
        "row_state": (rows + 1) * cfg.vocab_size * (4 + 4 + 1),
    }


def free_device_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes free on `device` (default: the first): from the runtime where it reports them
    (GPU, TPU), else the host's available memory (CPU). None when neither is known."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    rows: int,
    free: int | None = None,
    kv_dtype: str | None = None,
) -> None:
    """Raise ConfigError naming the settings when the engine would not fit in memory."""
    need = engine_bytes(cfg, num_pages, page_size, rows, kv_dtype)
    free = free_device_bytes() if free is None else free
    total = sum(need.values())
    if free is None or total <= free:
        return
    raise ConfigError(
        f"these engine sizes need {total / _GIB:.1f} GiB but the device has "
        f"{free / _GIB:.1f} GiB free: the KV cache takes {need['kv_cache'] / _GIB:.1f} GiB "
        f"(num_pages={num_pages} x page_size={page_size}), the row state "
        f"{need['row_state'] / _GIB:.1f} GiB ({rows} resident rows, from max_batch_size / "
        f"max_resident, x a vocabulary of {cfg.vocab_size}); lower them"
    )
