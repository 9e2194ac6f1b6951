"""How hard the suite's compilations optimize: not at all for tests of the engine's logic, as
users compile for tests that run a real model.

XLA:CPU compiles every fusion of a program into its own LLVM module, and optimizing those
modules is half of a step program's compile time (a tiny model's decode step: 3.9 s as users
compile, 1.95 s with LLVM's optimizations off, AMD EPYC, 2026-12-02). Most tests compile far
more than they run, and for them the unoptimized program is the faster test. Tests that run
SmolLM2 or Gemma 3 through etjax are the opposite (their programs ran 1.5-2.4x slower
unoptimized: a 3K-token prefill, bf16 matrix products), so they compile as users do: those
that take the `smollm2` or `gemma3_270m` fixture, and those marked `real_model`.

JAX's `jax_disable_most_optimizations` (LLVM at -O0, no expensive passes) changes how fast the
generated code runs, never what it computes: the HLO and XLA's optimizations of it are the
same, and every LLVM level keeps float semantics (XLA does not enable fast math). It is read
at each compilation, so the choice is made per test; subprocesses read it from the
environment (`JAX_DISABLE_MOST_OPTIMIZATIONS`). Programs are cached with their compile options
on disk; in memory, a program a test compiled one way could serve a later test that wanted
the other, which costs time, never a result. `ETJAX_TEST_OPTIMIZE=all` compiles every test as
users do.
"""

from __future__ import annotations

import os

import pytest

REAL_MODEL_FIXTURES = frozenset({"smollm2", "gemma3_270m"})
MARKER = "real_model"
ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def optimized(item: pytest.Item) -> bool:
    """Whether `item` compiles as users do."""
    if os.environ.get("ETJAX_TEST_OPTIMIZE") == "all":
        return True
    names = set(getattr(item, "fixturenames", ()))
    return bool(REAL_MODEL_FIXTURES & names) or item.get_closest_marker(MARKER) is not None


def apply(item: pytest.Item) -> None:
    """Set this process's compilations, and its subprocesses', for `item`."""
    import jax

    off = not optimized(item)
    jax.config.update("jax_disable_most_optimizations", off)
    os.environ[ENV] = "1" if off else "0"
