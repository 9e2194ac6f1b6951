"""The output of a batch job: one JSON line per input record, appended durably.

Each line is written whole, flushed and fsynced before the next request is considered done, so
a job killed at any moment leaves complete lines plus at most one torn line at the end. On
restart the torn tail is cut off and the ids already present are known, with the fingerprint
of the request each result came from and whether it was an error: the job skips what is done,
and `forget` drops the lines it will write again (errors retried, changed records redone) by
rewriting the file atomically. Every id appears once: nothing is lost or written twice.
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
        self.done: set[str | int] = set()  # ids with a result that is not an error
        self.errors: set[str | int] = set()  # ids whose result is an error
        self.fingerprints: dict[str | int, str | None] = {}  # None: written before fingerprints
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
                record = json.loads(line)
                key = record["id"]
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TypeError(f"id {key!r}")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{self.path}:{number}: not a result line written by etjax ({e}); "
                    "move the file away or choose another --output"
                ) from None
            self._note(record)

    def _note(self, record: dict) -> None:
        key = record["id"]
        self.fingerprints[key] = record.get("fingerprint")
        if record.get("error") is None:
            self.done.add(key)
            self.errors.discard(key)
        else:
            self.errors.add(key)
            self.done.discard(key)

    def forget(self, keys: set[str | int]) -> None:
        """Drop the results of `keys` from the file (written to a temporary file, fsynced and
        renamed over it, so the file is whole at every moment)."""
        if not keys:
            return
        self._file.close()
        temporary = self.path.with_name(self.path.name + ".rewriting")
        with open(self.path, "rb") as source, open(temporary, "wb") as target:
            for line in source:
                if json.loads(line)["id"] not in keys:
                    target.write(line)
            target.flush()
            os.fsync(target.fileno())
        temporary.replace(self.path)
        for key in keys:
            self.done.discard(key)
            self.errors.discard(key)
            self.fingerprints.pop(key, None)
        self._file = open(self.path, "ab")  # noqa: SIM115

    def append(self, record: dict) -> None:
        """Write one result durably."""
        line = json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._note(record)

    def close(self) -> None:
        self._file.close()
