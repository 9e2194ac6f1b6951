"""The environment of every subprocess a test starts: CPU only, this checkout importable, the
test run's compilation cache, and the test's compile level (tests/compile_level.py).

The engine and the CLI turn on JAX's persistent compilation cache (`~/.cache/etjax/xla` unless
JAX_COMPILATION_CACHE_DIR is set: etjax/compilation_cache.py). A test's subprocess must not
read what an earlier run left there, nor leave anything behind: it inherits the run's own
fresh cache (tests/session_cache.py, named in os.environ), so a resumed job warm-starts as it
would for a user, a worker reuses the programs the run compiled before it, and nothing
outlives the run.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import compile_level

ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(forced_devices: int | None = None) -> dict[str, str]:
    """os.environ for a child process of a test; `forced_devices` makes its JAX see that many
    CPU devices."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    flags = env.get("XLA_FLAGS", "").split()
    if forced_devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={forced_devices}")
    if env.get(compile_level.ENV) == "1":  # the test compiles cheaply, and so does its child
        flags.append(compile_level.LOOP_EMITTERS)
    env["XLA_FLAGS"] = " ".join(flags)
    # Every program a child compiles goes into the run's cache, however fast it compiled: a
    # child starts cold, and the next one (a rerun, a resumed job, another test's job) would
    # compile it again. The test process itself keeps the engine's threshold.
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env
