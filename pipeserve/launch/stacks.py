"""`kill -USR1 <pid>`: every thread's Python stack to that process's stderr (the server's log),
and it goes on serving. What a stalled step or a busy event loop is doing, on any machine, with
no profiler installed. The server's process and an engine core's child process each answer for
themselves: signal the child's pid for the engine's stacks under server.isolate=true or a pool."""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import FrameType


def format_stacks() -> str:
    """Every thread's stack, innermost call first, in faulthandler's layout. sys._current_frames
    holds the interpreter's thread lock and the GIL, so no frame changes while it is read."""
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        who = "Current thread" if ident == here else "Thread"
        out.append(f"{who} {ident:#018x} [{names.get(ident, '?')}] (most recent call first):\n")
        calls = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
        out.extend(f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in calls)
        out.append("\n")
    return "".join(out)


def _dump(_signum: int, _frame: FrameType | None) -> None:
    data = format_stacks().encode("utf-8", "replace")
    while data:   # one fd write, not sys.stderr: the handler may interrupt a write to it
        data = data[os.write(sys.stderr.fileno(), data):]


def dump_stacks_on_sigusr1() -> None:
    """A Python handler, run on the main thread between bytecodes. faulthandler's C handler
    reads other threads' frames from inside the signal while they run, and crashed a serving
    process doing so (a frame freed under it); this one reads them as Python's own APIs do."""
    if hasattr(signal, "SIGUSR1"):   # POSIX only
        signal.signal(signal.SIGUSR1, _dump)
