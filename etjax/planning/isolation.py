"""A call run in a child process, so that a crash there is an error here, not the end of this
process: the TPU compiler, compiling for a topology this host does not have, can die of a
signal (libtpu 0.0.42 overflowed a stack in its SparseCore code generation on a sharded v6e
program: docs/TPU.md), which in-process would take `etjax plan` down with it.

`run_isolated(function, *args)` pickles the call, runs it in a fresh Python (`sys.executable`,
this process's `sys.path`) and returns what it returned or raises what it raised; a child that
dies without answering raises `CompilerCrash`, naming what it was doing and the signal. The
child is a bare interpreter until the call is unpickled: the isolation itself costs a Python
start (tens of milliseconds), the call's imports cost what they cost.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from typing import Any

# The child: reads the path to import from and the call, runs it, writes ("ok", result) or
# ("raised", exception or None when it does not pickle both ways, its type and text,
# traceback). It
# ends itself when this process goes (killed, or ended by a timeout's SIGTERM, which leaves
# it no time to end its children): a compile would otherwise go on for minutes unwatched.
_CHILD = """
import os, pickle, sys, threading, time, traceback
def orphaned(parent=int(sys.argv[3])):
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)
threading.Thread(target=orphaned, daemon=True).start()
with open(sys.argv[1], "rb") as f:
    sys.path[:] = pickle.load(f)
    function, args = pickle.load(f)
try:
    answer = ("ok", function(*args))
except BaseException as e:
    text = "".join(traceback.format_exception(e))
    try:
        raised = pickle.loads(pickle.dumps(e))
    except Exception:
        raised = None
    answer = ("raised", raised, type(e).__name__, str(e), text)
with open(sys.argv[2], "wb") as f:
    pickle.dump(answer, f)
"""

# Lines of the child's stderr a crash report keeps (libtpu's own report: the signal and the
# top of the stack).
_REPORT_LINES = 14


class CompilerCrash(RuntimeError):
    """A child process died without answering (a signal, or an exit with no result): `what` it
    was doing, `signal_name` ("SIGSEGV") or None, `returncode`, `report` (the child's last
    words on stderr, libtpu's crash report among them)."""

    def __init__(self, what: str, returncode: int, report: str = "") -> None:
        self.what, self.returncode, self.report = what, returncode, report
        self.signal_name = _signal_name(-returncode) if returncode < 0 else None
        if self.signal_name:
            how = f"killed by {self.signal_name} (signal {-returncode})"
        else:
            how = f"exited with status {returncode} without an answer"
        super().__init__(f"{what}: the process was {how}")


class ChildError(RuntimeError):
    """An exception of the child's that does not pickle: its type's name (`kind`) and text."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(f"{kind}: {text}")
        self.kind = kind


def run_isolated(function, *args, what: str, env: dict[str, str] | None = None) -> Any:
    """`function(*args)` in a child process (`function` and `args` must pickle; `function` a
    module-level one): what it returns, or the exception it raised (re-raised here; one that
    does not pickle as a `ChildError` with its text), or `CompilerCrash` when the child dies
    (`what`: what it was doing, for the message). `env`: the child's variables added to this
    process's."""
    child_env = dict(os.environ, **(env or {}))
    with tempfile.TemporaryDirectory(prefix="etjax-isolated-") as tmp:
        call, answer = os.path.join(tmp, "call.pickle"), os.path.join(tmp, "answer.pickle")
        with open(call, "wb") as f:
            pickle.dump(list(sys.path), f)
            pickle.dump((function, args), f)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, call, answer, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=child_env,
        )
        try:
            _, err = child.communicate()
        except BaseException:  # interrupted here: the child goes too
            child.kill()
            child.wait()
            raise
        if not os.path.exists(answer):
            raise CompilerCrash(what, child.returncode, crash_report(err.decode(errors="replace")))
        with open(answer, "rb") as f:
            result = pickle.load(f)
    if result[0] == "ok":
        return result[1]
    _, raised, kind, text, trace = result
    if raised is None:
        raised = ChildError(kind, text)
    raised.add_note(f"raised in the child process of {what}:\n{trace}")
    raise raised


def crash_report(stderr: str) -> str:
    """The part of a crashed child's stderr that says why: from libtpu's "*** SIG..." line
    (the signal and the stack), else the last lines; at most `_REPORT_LINES` lines."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("*** SIG")), None)
    kept = lines[start : start + _REPORT_LINES] if start is not None else lines[-_REPORT_LINES:]
    return "\n".join(kept)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
