"""The output of a batch job: one JSON line per input record, appended durably.

Lines are written whole with `os.write` (no buffer that could hold half a line), and `sync`
fsyncs them: the job syncs once per engine round, so a result counts as done once the round
that finished it is on disk. A job killed at any moment leaves complete lines plus at most one
torn line at the end. On restart the file is read line by line (never whole): the torn tail is
cut off, and the ids already present are known, with the fingerprint of the request each
result came from and whether it was an error. The job skips what is done, and `forget` drops
the lines it will write again (errors retried, changed records redone) by rewriting the file
atomically. Every id appears once: nothing is lost or written twice.

A write that fails (a full disk, a file-size limit, an I/O error) cuts the file back to its
last complete line and raises JobError naming the file and the error.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from etjax.errors import JobError


def result_key(record: dict) -> str | int:
    """The record id a result line answers: an OpenAI output line's "custom_id" (its "id" is
    the line's own), else its "id"."""
    return record["custom_id"] if "custom_id" in record else record["id"]


class ResultsFile:
    """Append-only JSONL of results, keyed by record id."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str | int] = set()  # ids with a result that is not an error
        self.errors: set[str | int] = set()  # ids whose result is an error
        self.fingerprints: dict[str | int, str | None] = {}  # None: written before fingerprints
        self.written = 0  # lines in the file
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise JobError(f"cannot open {path} for writing: {e.strerror}") from e
        try:
            self._size = self._recover()  # bytes of complete lines
        except BaseException:
            os.close(self._fd)
            raise

    def _recover(self) -> int:
        size = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    break  # a torn write: cut below
                try:
                    record = json.loads(line)
                    key = result_key(record)
                    if not isinstance(key, str | int) or isinstance(key, bool):
                        raise TypeError(f"id {key!r}")
                except (ValueError, KeyError, TypeError) as e:
                    raise JobError(
                        f"{self.path}:{number}: not a result line written by etjax ({e}); "
                        "move the file away or choose another --output"
                    ) from None
                self._note(record)
                size += len(line)
        if size < os.fstat(self._fd).st_size:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        return size

    def _note(self, record: dict) -> None:
        key = result_key(record)
        self.fingerprints[key] = record.get("fingerprint")
        self.written += 1
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
        temporary = self.path.with_name(self.path.name + ".rewriting")
        size, kept = 0, 0
        try:
            with open(self.path, "rb") as source, open(temporary, "wb") as target:
                for line in source:
                    if result_key(json.loads(line)) not in keys:
                        target.write(line)
                        size += len(line)
                        kept += 1
                target.flush()
                os.fsync(target.fileno())
            temporary.replace(self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise self._error("rewrite", e) from e
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self._size, self.written = size, kept
        for key in keys:
            self.done.discard(key)
            self.errors.discard(key)
            self.fingerprints.pop(key, None)

    def append(self, record: dict) -> None:
        """Write one result (durable at the next `sync`). A string that is no Unicode text (a
        lone surrogate, which records refuse) is written as JSON's escape of it, `\\ud800`:
        the line stays UTF-8 and reads back as the same string, so a rerun knows its id."""
        text = json.dumps(record, ensure_ascii=False)
        # Surrogates occur only inside JSON strings, where "\ud800" is the escape of one.
        line = text.encode("utf-8", "backslashreplace") + b"\n"
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise self._error("write to", e) from e
        self._size += len(line)
        self._note(record)

    def sync(self) -> None:
        """Make every appended line durable."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise self._error("sync", e) from e

    def _error(self, doing: str, e: OSError) -> JobError:
        # Cut a half-written line so the file stays valid (freeing space on a full disk).
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        return JobError(
            f"cannot {doing} {self.path}: {e.strerror or e}; its {self.written} complete "
            "results are intact; fix the cause and rerun the same command to resume"
        )

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
