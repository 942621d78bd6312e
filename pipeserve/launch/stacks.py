"""`kill -USR1 <pid>`: every thread's Python stack to that process's stderr (the server's log),
and it goes on serving. What a stalled step or a busy event loop is doing, on any machine, with
no profiler installed. The server's process and an engine core's child process each answer for
themselves: signal the child's pid for the engine's stacks under server.isolate=true or a pool."""
from __future__ import annotations

import faulthandler
import signal
import sys


def dump_stacks_on_sigusr1() -> None:
    """Register the dump (a C handler: it runs even while every thread is busy)."""
    if hasattr(signal, "SIGUSR1"):   # POSIX only
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
