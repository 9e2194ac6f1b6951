"""Count the programs a piece of code needed that were not already loaded in this process.

A program is new to the process when XLA compiles it or when it comes from the run's
persistent compilation cache (tests/session_cache.py): both mean the in-memory cache missed,
which is what a no-recompilation test asserts never happens after warm-up. Counting XLA's
compilations alone would depend on whether another test or worker had compiled the program
into the shared cache first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_COMPILED = "/jax/core/compile/backend_compile_duration"
_READ_FROM_CACHE = "/jax/compilation_cache/cache_retrieval_time_sec"


@contextlib.contextmanager
def counting_new_programs() -> Iterator[list[int]]:
    """`with counting_new_programs() as count:` ... `count[0]` programs were new inside."""
    count = [0]

    def listener(event: str, duration: float, **_: object) -> None:
        if event in (_COMPILED, _READ_FROM_CACHE):
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
