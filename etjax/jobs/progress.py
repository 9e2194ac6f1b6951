"""A one-line progress display for batch jobs: requests done, tokens/s, ETA."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    def __init__(self, total: int, done: int = 0, stream: IO[str] | None = None) -> None:
        self.total, self.done, self.tokens = total, done, 0
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self._start_done = done
        self._last = 0.0

    def update(self, requests: int = 0, tokens: int = 0, force: bool = False) -> None:
        self.done += requests
        self.tokens += tokens
        now = time.perf_counter()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self._start_done) / elapsed
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r[{bar}] {self.done}/{self.total} requests  {self.tokens / elapsed:.1f} tok/s  "
            f"ETA {eta}   "
        )
        self.stream.flush()

    def close(self) -> None:
        self.update(force=True)
        self.stream.write("\n")
        self.stream.flush()
