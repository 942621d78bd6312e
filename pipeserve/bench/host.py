"""The host a run was timed on. A lent VM's speed swings between processes (a decode step
1.6x slower from one job to the next, the engine in its own process or not: round 32), so each
timed part records how much CPU the hypervisor took from the machine meanwhile and how fast one
core ran fixed Python work just before; rows are compared where those agree."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def steal_s() -> float:
    """CPU seconds the hypervisor has taken from this machine so far, all CPUs summed
    (/proc/stat's steal column); 0.0 where there is none to read (not Linux, bare metal)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(first[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def probe_ms(reps: int = 5) -> float:
    """Median milliseconds of a fixed pure-Python loop on the calling thread: one core's speed
    now, for work like the engine's host side (building a step's graph is Python and C++)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x = 0
        for i in range(100_000):
            x += i * i % 7
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)
