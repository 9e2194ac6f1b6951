"""A test's subprocess compiles as the test does (tests/compile_level.py), with the same
compile options: so the same persistent-cache keys, and the test and its children reuse each
other's programs from the run's cache (tests/session_cache.py).

The test process picks XLA's loop emitters per compilation, as a compile option
(`compile_level._install_emitter_choice`); a child given them in XLA_FLAGS instead would
compile alike but under another cache key (XLA_FLAGS and compile options are both part of
it), and so never read what the test compiled. tests/subprocess_env.py puts this folder on a
cheaply compiling test's child's PYTHONPATH; JAX imports every module of the `jax_plugins`
namespace package when it starts its backends, before any compilation, and calls its
`initialize()`.
"""

from __future__ import annotations


def initialize() -> None:
    """Install the test process's emitter choice for every compilation of this process."""
    from tests import compile_level

    compile_level.compile_cheaply()
