"""The suite compiles with LLVM's optimizations off: programs compile in half the time.

XLA:CPU compiles every fusion of a program into its own LLVM module, and optimizing those
modules is half of a step program's compile time (a tiny model's decode step: 3.9 s at the
default level, 1.95 s at level 0, AMD EPYC, 2026-12-02); most tests compile far more than they
run. The level changes how fast the generated code runs (SmolLM2's batch-8 step is 2x slower,
so users and benchmarks keep the default), never what it computes: the HLO and its
optimizations are the same, and LLVM's levels all keep float semantics (XLA does not enable
fast math). Matrix products run in the same libraries either way.

Set before any JAX backend starts, in os.environ, so the run's subprocesses compile alike. A
level already named in XLA_FLAGS wins: `XLA_FLAGS=--xla_backend_optimization_level=3 pytest`
runs the suite as users compile.
"""

from __future__ import annotations

import os

OPTION = "--xla_backend_optimization_level"
TEST_LEVEL = 0


def apply() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if OPTION not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {OPTION}={TEST_LEVEL}".strip()
