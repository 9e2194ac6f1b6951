"""The output of a batch job: one JSON line per input record, appended durably.

Each line is written whole, flushed and fsynced before the next request is considered done, so
a job killed at any moment leaves complete lines plus at most one torn line at the end. On
restart the torn tail is cut off and the ids already present are skipped: nothing is lost and
nothing is written twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO


class ResultsFile:
    """Append-only JSONL of results, keyed by record id."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        if path.exists():
            self._recover()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - lives as long as the job

    def _recover(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
        if end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        for number, line in enumerate(data[:end].splitlines(), start=1):
            try:
                self.done.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{self.path}:{number}: not a result line written by etjax ({e}); "
                    "move the file away or choose another --output"
                ) from None

    def append(self, record: dict) -> None:
        """Write one result durably."""
        line = json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(str(record["id"]))

    def close(self) -> None:
        self._file.close()
