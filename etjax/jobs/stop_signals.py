"""`StopSignals`: SIGTERM and SIGINT ask a batch job to stop instead of killing it mid-write.

A preempted TPU VM or a scheduler sends SIGTERM first and kills a little later; Ctrl-C sends
SIGINT. Inside the block, the first of either only records its number: the job finishes the
round it is in, saves every completed result and stops (JobInterrupted). A second signal acts
as it would without the block, for someone who really means it: a torn last line is cut on the
next run, so even then nothing is lost. Handlers can only be set from the main thread;
elsewhere the block does nothing and signals act as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _note(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = number
            return
        self.__exit__()
        signal.raise_signal(number)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""
