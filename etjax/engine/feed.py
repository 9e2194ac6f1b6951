"""`run_fed`: the one loop that runs an engine over more work than it should hold at once.

A feeder (`Engine.generate`, a batch job) has an iterator of work items, each one or more
requests. The loop keeps at most `Engine.feed_window` items in the engine, runs rounds, and
hands each item back once all its requests are done, in the order they finish. So a round's
scans stay short however long the input, and admission never runs dry. Items the feeder does
not submit (a record it answered with an error) never enter the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar


class Handle(Protocol):
    """A submitted request (`Engine.submit`'s `RequestHandle`), as the loop sees it."""

    @property
    def done(self) -> bool: ...


class Fed(Protocol):
    """An engine, as the loop drives it (etjax/engine/engine.py `Engine`)."""

    @property
    def feed_window(self) -> int: ...

    def step(self) -> object: ...


T = TypeVar("T")
H = TypeVar("H", bound=Handle)
InFlight = list[tuple[T, list[H]]]
_END = object()  # what `next` returns when the items run out (an item may be None)


def run_fed(
    engine: Fed,
    items: Iterable[T],
    submit: Callable[[T], list[H] | None],
    on_done: Callable[[T, list[H]], None],
    on_round: Callable[[InFlight], None] | None = None,
    after_round: Callable[[int], None] | None = None,
) -> None:
    """Run `engine` until every item of `items` is done.

    submit(item): the item's request handles, or None when it was not submitted;
    on_done(item, handles): once all its handles are done; on_round(in_flight): after each
    round, before the finished are handed back (streamed text, progress);
    after_round(count): after they are, with the number still in flight (a checkpoint).
    """
    pending = iter(items)
    in_flight: InFlight = []
    more = True
    while True:
        while more and len(in_flight) < engine.feed_window:
            item = next(pending, _END)
            if item is _END:
                more = False
                break
            handles = submit(item)
            if handles is not None:
                in_flight.append((item, handles))
        if not in_flight:
            return
        engine.step()
        if on_round is not None:
            on_round(in_flight)
        still = []
        for item, handles in in_flight:
            if all(h.done for h in handles):
                on_done(item, handles)
            else:
                still.append((item, handles))
        in_flight = still
        if after_round is not None:
            after_round(len(in_flight))
