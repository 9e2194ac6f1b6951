"""Progress of `etjax bench`: one line per piece of work, with elapsed time and an ETA.

Pieces last minutes on a CPU, so a line per piece (rather than a redrawn bar) keeps a log
readable and shows where the time went.
"""

from __future__ import annotations

import sys
import time
from typing import IO


class StageProgress:
    def __init__(self, total: int, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()

    def stage(self, label: str) -> None:
        """Announce the next piece of work."""
        elapsed = time.perf_counter() - self.started
        eta = (
            f", ETA {_minutes(elapsed / self.done * (self.total - self.done))}" if self.done else ""
        )
        self.done += 1
        if self.enabled:
            width = 20
            filled = int(width * (self.done - 1) / max(self.total, 1))
            self.stream.write(
                f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{_minutes(elapsed)} elapsed{eta}: {label}\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            elapsed = _minutes(time.perf_counter() - self.started)
            self.stream.write(f"[{'#' * 20}] done in {elapsed}\n")
            self.stream.flush()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
