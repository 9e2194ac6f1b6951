"""The environment of every subprocess a test starts: CPU only, this checkout importable, and a
compilation cache of its own.

The engine and the CLI turn on JAX's persistent compilation cache (`~/.cache/etjax/xla` unless
JAX_COMPILATION_CACHE_DIR is set: etjax/compilation_cache.py). A test's subprocess must not
read what an earlier run left there, nor leave anything behind: the suite stays hermetic and
its time does not depend on history. Each test passes its own `tmp_path`, so processes of one
test may share the cache (a resumed job warm-starts, as it would for a user) and nothing
crosses tests.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(tmp_path: Path, forced_devices: int | None = None) -> dict[str, str]:
    """os.environ for a child process of the test that owns `tmp_path`; `forced_devices`
    makes its JAX see that many CPU devices."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cache = tmp_path / "jax-compilation-cache"
    cache.mkdir(exist_ok=True)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    if forced_devices is not None:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={forced_devices}"
        env["XLA_FLAGS"] = env["XLA_FLAGS"].strip()
    return env
