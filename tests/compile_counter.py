"""Count the programs a piece of code needed that were not already loaded in this process.

A program is new to the process when XLA compiles it or when it comes from the run's
persistent compilation cache (tests/session_cache.py): both mean the in-memory cache missed,
which is what a no-recompilation test asserts never happens after warm-up. JAX reports both
as one event (its "backend compile" span encloses the persistent cache's look-up), so the
count does not depend on whether another test or worker put the program in the cache first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_NEW_PROGRAM = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_new_programs() -> Iterator[list[int]]:
    """`with counting_new_programs() as count:` ... `count[0]` programs were new inside."""
    count = [0]

    def listener(event: str, duration: float, **_: object) -> None:
        if event == _NEW_PROGRAM:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
