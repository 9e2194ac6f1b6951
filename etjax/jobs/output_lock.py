"""`output_lock`: one process at a time writes a results file.

An advisory `flock` on `<output>.lock`, which also holds the owner's pid for the message. The
kernel drops the lock when its owner exits, however it exits, so a lock file left behind by a
killed job is free and the next run takes it over. The file is removed on release; a process
that opened it just before that finds, once it holds the lock, that the path now names
another file (or none), and starts over, so two processes can never both hold the lock.
Within one process the lock is reentrant: the CLI takes it before loading the model (a second
job fails in a second) and `run_batch` takes it again for callers of the Python API.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from etjax.errors import JobError

_held: dict[Path, list[int]] = {}  # resolved lock path -> [fd, depth]


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold the lock of `output` for the block; JobError if another process holds it."""
    path = lock_path(output).resolve()
    if path in _held:
        _held[path][1] += 1
        try:
            yield
        finally:
            _held[path][1] -= 1
        return
    fd = _acquire(path, output)
    _held[path] = [fd, 1]
    try:
        yield
    finally:
        del _held[path]
        # Unlink while still holding the lock, then close (which releases it).
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _acquire(path: Path, output: Path) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise JobError(f"cannot create the lock file {path} of {output}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JobError(
                f"{output} is being written by another etjax process (pid {owner}, lock "
                f"{path}); wait for it to finish, or write to another --output"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # released and removed by its last owner meanwhile: try again
