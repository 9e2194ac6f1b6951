"""Progress of `etjax bench`: which piece of work runs, how many are done, and an ETA.

Where someone watches (a terminal, a notebook) a `tqdm.auto` bar over the pieces, its label
the piece running now. Where output is captured, one log line per piece (pieces last minutes
on a CPU, so a line each keeps a log readable and shows where the time went), to the `etjax`
logger, which the CLI prints.
"""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from etjax.progress import watched

log = logging.getLogger("etjax")


class StageProgress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.started = time.perf_counter()
        self._bar = tqdm(total=total, unit="piece", desc="bench") if enabled and watched() else None

    def stage(self, label: str) -> None:
        """Announce the next piece of work (the previous one is done)."""
        if self._bar is not None:
            if self.done:
                self._bar.update(1)
            self._bar.set_description_str(label)
        elif self.enabled:
            elapsed = time.perf_counter() - self.started
            left = elapsed / self.done * (self.total - self.done) if self.done else None
            eta = f", ETA {_minutes(left)}" if left is not None else ""
            log.info(
                "bench %d/%d, %s elapsed%s: %s",
                self.done + 1,
                self.total,
                _minutes(elapsed),
                eta,
                label,
            )
        self.done += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self.total - self._bar.n)
            self._bar.close()
        elif self.enabled:
            log.info("bench done in %s", _minutes(time.perf_counter() - self.started))


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
