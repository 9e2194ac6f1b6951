"""`Progress`: requests done, tokens/s and an ETA, for `etjax batch` and `decode(progress=True)`.

Where someone watches (a terminal, a notebook) it is a `tqdm.auto` bar, a widget in Jupyter
and Colab. Where output is captured (a log file, a scheduler's stdout) a redrawn bar would run
into one long line, so it logs a plain line to the `etjax` logger every `LOG_EVERY_S` seconds
and at the end instead. The total is the work still to do now: a rerun's finished records are
not in it, and records rejected before they run are counted apart ("rejected"), so they do not
speed up the ETA.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("etjax")
LOG_EVERY_S = 30.0


def watched() -> bool:
    """Whether someone watches the output: a terminal, or a Jupyter or IPython shell."""
    if sys.stderr.isatty():
        return True
    shell = sys.modules.get("IPython")  # imported only inside IPython and Jupyter
    return shell is not None and getattr(shell, "get_ipython", lambda: None)() is not None


class Progress:
    def __init__(self, total: int, label: str = "requests") -> None:
        self.total, self.label = total, label
        self.done = self.tokens = self.rejected = 0
        self.started = self._logged = time.perf_counter()
        self._bar = (
            tqdm(total=total, unit="req", desc=label, dynamic_ncols=True) if watched() else None
        )

    def update(self, requests: int = 0, tokens: int = 0) -> None:
        self.done += requests
        self.tokens += tokens
        if self._bar is not None:
            if requests:
                self._bar.update(requests)
            self._bar.set_postfix_str(self._postfix(), refresh=False)
        elif time.perf_counter() - self._logged >= LOG_EVERY_S:
            self._log()

    def reject(self) -> None:
        """A request that failed validation: counted, but not as work done."""
        self.rejected += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())
            self._bar.close()
        else:
            self._log()

    def _postfix(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rejected = f", {self.rejected} rejected" if self.rejected else ""
        return f"{self.tokens / elapsed:.1f} tok/s{rejected}"

    def _log(self) -> None:
        self._logged = now = time.perf_counter()
        rate = self.done / max(now - self.started, 1e-9)
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        log.info(
            "%s: %d/%d done, %s, ETA %s", self.label, self.done, self.total, self._postfix(), eta
        )
