"""Host limits that a long CPU run can hit long after it started, checked before it starts.

On CPU, XLA loads every compiled program as JIT code with memory mappings of its own (over a
hundred for a small program of a dozen fused kernels, with JAX 0.10.2), and a process keeps
every program it has compiled. Linux caps mappings per process at `vm.max_map_count`, 65530
by default. An ablation compiles hundreds of programs (every prefill chunk, batch size,
attention width and kept-table width, under each pruning setting); once it reaches the cap,
LLVM reports "Cannot allocate memory" for each new program and the process crashes, an hour
into a run, with nothing written. (GPU and TPU programs live on the device and never meet
this cap.)
"""

from __future__ import annotations

import logging
from pathlib import Path

# Measured: `etjax bench --requests 32` with the five ablation configs peaked at about 74K
# mappings (docs/PERF.md, ablation). Four times the default leaves room for longer runs.
RECOMMENDED_MAP_COUNT = 262144
_MAP_COUNT_FILE = Path("/proc/sys/vm/max_map_count")


def map_count_limit(path: Path = _MAP_COUNT_FILE) -> int | None:
    """The kernel's cap on memory mappings per process; None where there is none to read."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def current_map_count(path: Path = Path("/proc/self/maps")) -> int:
    """How many memory mappings this process holds now; 0 where that cannot be read."""
    try:
        with path.open() as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def map_count_warning(platform: str, limit: int | None, needed: int) -> str | None:
    """The warning for a run on `platform` that may need `needed` mappings, or None."""
    if platform != "cpu" or limit is None or limit >= needed:
        return None
    return (
        f"vm.max_map_count is {limit}. On CPU, XLA maps memory for every program it compiles "
        f"and this run may need about {needed}; past the limit compilation fails with 'LLVM "
        "compilation error: Cannot allocate memory' and the process crashes. Raise it first: "
        "sudo sysctl -w vm.max_map_count=1048576"
    )


def warn_if_map_count_low(needed: int = RECOMMENDED_MAP_COUNT) -> None:
    """Log `map_count_warning` for the default JAX backend, if there is one."""
    import jax

    message = map_count_warning(jax.default_backend(), map_count_limit(), needed)
    if message:
        logging.getLogger("etjax").warning("warning: %s", message)
