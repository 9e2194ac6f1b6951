"""`use_persistent_cache`: compile each program once per machine, not once per process.

Compiling the step programs is most of a first `decode()` (PERF.md, "warm start"); JAX's
persistent compilation cache keeps them on disk, so every later process, a notebook's next
session or the next CLI run, starts in seconds. The engine turns it on when it is built
(`build_engine`), in `$XDG_CACHE_HOME/etjax/xla` (`~/.cache/etjax/xla`), unless:

- the caller has configured JAX's cache already (`JAX_COMPILATION_CACHE_DIR`, or
  `jax.config.jax_compilation_cache_dir`): theirs is used, untouched;
- `ETJAX_COMPILATION_CACHE` is `0`, `off`, `false` or `no` (any other value is a directory
  to use instead), or the run config says `compilation_cache = false` in `[engine]`.

The setting is JAX's and so the process's: the first engine built decides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV = "ETJAX_COMPILATION_CACHE"
_OFF = {"0", "off", "false", "no"}
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a disk entry


def chosen_directory(
    enabled: bool, environ: Mapping[str, str], jax_configured: str | None
) -> Path | None:
    """Where the cache goes, or None for off (the rules of the module docstring)."""
    configured = environ.get("JAX_COMPILATION_CACHE_DIR") or jax_configured
    if configured:
        return Path(configured)
    value = environ.get(ENV, "").strip()
    if not enabled or value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    home = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "etjax" / "xla"


def use_persistent_cache(enabled: bool = True) -> Path | None:
    """Turn JAX's persistent compilation cache on (see the module docstring); returns the
    directory in use, or None when it stays off."""
    import jax

    configured = jax.config.jax_compilation_cache_dir
    directory = chosen_directory(enabled, os.environ, configured)
    if directory is not None and not configured:
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return directory
