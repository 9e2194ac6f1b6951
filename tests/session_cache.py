"""One JAX compilation cache per test run: hermetic, and shared by every process of the run.

The engine and the CLI turn on JAX's persistent compilation cache (in the user's home unless
configured: etjax/compilation_cache.py). A test run must not read what an earlier run left
there, or its time and its compile counts would depend on history. Yet within one run the
same programs are compiled again and again: after the suite releases compiled programs
(conftest.py), and by each subprocess a test starts (batch jobs, meshes of forced devices,
resumed runs, processes of one job). So the process that starts the run makes a new, empty
directory, every process of the run (xdist workers if any, subprocesses) compiles into and
reads from it, and the starting process deletes it at the end.

Compiled executables are a pure function of the program and the compiler, so a program read
from the cache is the one a compilation would produce: no test outcome depends on which
process compiled it first. Tests that count compilations count cache hits as well
(tests/compile_counter.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from etjax.compilation_cache import MIN_COMPILE_SECONDS

VARIABLE = "JAX_COMPILATION_CACHE_DIR"
# Set by `create` so that `remove` deletes only what this run made, never a caller's own.
_MADE_HERE = "ETJAX_TEST_SESSION_CACHE"


def create() -> None:
    """Make this run's empty cache directory and name it in the environment that workers and
    subprocesses inherit."""
    directory = tempfile.mkdtemp(prefix="etjax-test-xla-")
    os.environ[VARIABLE] = directory
    os.environ[_MADE_HERE] = directory
    # The engine's own threshold (programs that compile faster are not worth a disk entry),
    # also for subprocesses: JAX reads it from the environment.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(MIN_COMPILE_SECONDS)


def use() -> None:
    """Point this process's JAX at the run's cache."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)


def remove() -> None:
    directory = os.environ.pop(_MADE_HERE, None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
