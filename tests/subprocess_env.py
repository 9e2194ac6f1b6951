"""The environment of every subprocess a test starts: CPU only, this checkout importable, the
test run's compilation cache, and the test's compile level (tests/compile_level.py), chosen
as the test chooses it (tests/child_site), so that the two share compiled programs.

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
CHILD_SITE = Path(__file__).resolve().parent / "child_site"


def subprocess_env(forced_devices: int | None = None) -> dict[str, str]:
    """os.environ for a child process of a test; `forced_devices` makes its JAX see that many
    CPU devices."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    paths = [str(ROOT)]
    if env.get(compile_level.ENV) == "1":
        # The test compiles cheaply, and so does its child, under the same compile options
        # (not XLA_FLAGS, part of a cache key too): a program either compiled, the other
        # reads from the run's cache.
        paths.append(str(CHILD_SITE))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    if forced_devices is not None:  # a flag that cache keys leave out
        flags = env.get("XLA_FLAGS", "").split()
        flags.append(f"--xla_force_host_platform_device_count={forced_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    # Every program a child compiles goes into the run's cache, however fast it compiled: a
    # child starts cold, and the next one (a rerun, a resumed job, another test's job) would
    # compile it again. The test process itself keeps the engine's threshold.
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env
