"""How hard the suite's compilations work: as little as XLA allows for tests of the engine's
logic, as users compile for tests that run a real model.

XLA:CPU compiles every fusion of a program into its own kernel, and generating and optimizing
those kernels is most of a step program's compile time. Two switches cut it, both read at each
compilation, so the choice is made per test:

- LLVM's optimizations off (`jax_disable_most_optimizations`: -O0, no expensive passes). A tiny
  model's decode step: 3.9 s as users compile, 1.95 s at -O0 (AMD EPYC, 2026-12-02).
- XLA:CPU's loop emitters instead of its MLIR fusion emitters (the debug option
  `xla_cpu_use_fusion_emitters=false`): they write each fusion's LLVM IR directly instead of
  lowering it through MLIR's pipeline. On top of -O0, a tiny `decode()`'s step programs
  compile in 2.3-2.4 s instead of 3.9-4.7 s (AMD EPYC Zen 5, 2026-12-02,
  /tmp-script timing five alternating runs, cache off).

Most tests compile far more than they run, and for them the cheaply compiled program is the
faster test. Tests that run SmolLM2 or Gemma 3 through etjax are the opposite: their programs
ran 1.5-2.4x slower at -O0 (a 3K-token prefill, bf16 matrix products) and 1.65x slower with the
loop emitters (SmolLM2's 3K-token prefill, 8.7 s against 5.3 s), so they compile as users do:
those that take the `smollm2` or `gemma3_270m` fixture, and those marked `real_model`. Except
those marked `compile_bound`: tests on SmolLM2 that compare etjax with itself (or only check
validity) over short prompts, whose many programs cost more to compile well than they gain
(test_engine_smollm2.py: 24.6 and 25.4 s against 31.5 and 29.2 as users compile).

Neither switch changes what a program computes beyond float rounding: the HLO and XLA's
passes over it are the same, and no emitter or LLVM level enables fast math (XLA does not).
Subprocesses follow through the environment (`tests/subprocess_env.py`):
`JAX_DISABLE_MOST_OPTIMIZATIONS`, and the emitter choice made as here (`compile_cheaply`,
through tests/child_site), not by `XLA_FLAGS`: XLA reads those once per process (they would
hold for every later test here), and a child compiling under other flags would not share the
run's cache with this process.
Compile options are part of the persistent cache's key; in memory, a program a test compiled
one way could serve a later test that wanted the other, which costs time, never a result.
`ETJAX_TEST_OPTIMIZE=all` compiles every test as users do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a test's child imports this module too (compile_cheaply), without pytest
    import pytest

REAL_MODEL_FIXTURES = frozenset({"smollm2", "gemma3_270m"})
MARKER = "real_model"
CHEAP_MARKER = "compile_bound"
ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"  # XLA's debug option; false: loop emitters
LOOP_EMITTERS = f"--{FUSION_EMITTERS}=false"  # the same, as an XLA_FLAGS entry

_cheap = [False]  # whether this process compiles the current test cheaply


def optimized(item: pytest.Item) -> bool:
    """Whether `item` compiles as users do."""
    if os.environ.get("ETJAX_TEST_OPTIMIZE") == "all":
        return True
    if item.get_closest_marker(CHEAP_MARKER) is not None:
        return False
    names = set(getattr(item, "fixturenames", ()))
    return bool(REAL_MODEL_FIXTURES & names) or item.get_closest_marker(MARKER) is not None


def apply(item: pytest.Item) -> None:
    """Set this process's compilations, and its subprocesses', for `item`."""
    import jax

    _install_emitter_choice()
    cheap = not optimized(item)
    _cheap[0] = cheap
    jax.config.update("jax_disable_most_optimizations", cheap)
    os.environ[ENV] = "1" if cheap else "0"  # for subprocesses (tests/subprocess_env.py)


def compile_cheaply() -> None:
    """Compile every program of this process as a cheaply compiled test does: for a test's
    child process (tests/child_site), which turns -O0 on through the environment."""
    _install_emitter_choice()
    _cheap[0] = True


@contextlib.contextmanager
def as_users_compile():
    """Within this block, this process compiles as users do, whatever the current test's
    level: for a `compile_bound` test's one large reference pass, which runs faster well
    compiled than it compiles (a [6, 321] SmolLM2 prefill: 15.8 s of CPU, compile included,
    cheaply, against 8.4; AMD EPYC Zen 4, 2026-12-07)."""
    import jax

    _install_emitter_choice()
    cheap = _cheap[0]
    _cheap[0] = False
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        _cheap[0] = cheap
        jax.config.update("jax_disable_most_optimizations", cheap)


@functools.cache
def _install_emitter_choice() -> None:
    # JAX has no configuration for XLA's debug options per compilation, only `compiler_options`
    # per jitted function; every compilation's options pass through this function, which
    # takes such options as overrides. Where a JAX version has changed it, tests compile with
    # the fusion emitters, as before: slower, never wrong.
    from jax._src import compiler

    original = compiler.get_compile_options
    if "env_options_overrides" not in inspect.signature(original).parameters:
        return

    @functools.wraps(original)
    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        if _cheap[0]:
            env_options_overrides = {FUSION_EMITTERS: False, **(env_options_overrides or {})}
        return original(*args, env_options_overrides=env_options_overrides, **kwargs)

    compiler.get_compile_options = get_compile_options
