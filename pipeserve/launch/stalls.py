"""server.stall_report_ms: a watchdog thread that logs each time the event loop, or every
Python thread at once (the GIL held by a C call), went that long without running, with where
each thread was. What delays a burst's handlers or a step, seen on any machine (a lent GPU
keeps only files) with no profiler attached. Off by default: it takes the GIL every tick."""
from __future__ import annotations

import asyncio
from collections import Counter
import logging
import os
import sys
import threading
import time
from types import FrameType

log = logging.getLogger("pipeserve.stalls")

DEPTH = 8   # innermost frames kept of each stack


def stack(frame: FrameType | None, depth: int = DEPTH) -> str:
    """`file:line function` of the innermost `depth` frames, innermost first."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        where = os.path.join(*code.co_filename.split(os.sep)[-2:])
        out.append(f"{where}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


def stacks(skip: int) -> dict[str, str]:
    """Every Python thread's stack but `skip`'s, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, str(ident)): stack(frame)
            for ident, frame in sys._current_frames().items() if ident != skip}


class StallWatch:
    """Wakes every `tick_s`. A wake later than `threshold_s`: no thread let it run for that
    long (a C call holding the GIL, or the process off the CPU); logged with every thread's
    stack as last seen before and right after. The event loop beats every tick too; when it
    goes `threshold_s` without a beat, the watchdog samples the loop thread's stack each tick
    until it beats again, and logs the stall with its most frequent stacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_s: float,
                 tick_s: float = 0.005) -> None:
        self.loop, self.threshold_s, self.tick_s = loop, threshold_s, tick_s
        self.beat = time.perf_counter()
        self.stalls = {"gil": 0, "loop": 0}   # stalls logged, by kind
        self._stop = threading.Event()
        self._loop_name = threading.current_thread().name   # started on the loop
        self._thread = threading.Thread(target=self._run, name="pipeserve-stalls", daemon=True)

    def start(self) -> StallWatch:
        self.loop.call_soon(self._beat)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        self.beat = time.perf_counter()
        if not self._stop.is_set():
            self.loop.call_later(self.tick_s, self._beat)

    def _run(self) -> None:
        me = threading.get_ident()
        before = stacks(me)
        busy: Counter[str] = Counter()   # the loop thread's stacks while it has not beaten
        busy_since = 0.0
        expected = time.perf_counter() + self.tick_s
        while not self._stop.wait(self.tick_s):
            now = time.perf_counter()
            late = now - expected
            after = stacks(me)
            if late > self.threshold_s:
                self.stalls["gil"] += 1
                log.warning("stall: no Python thread ran for %.0f ms (a C call holding the "
                            "GIL, or the process off the CPU); before: %s; after: %s",
                            late * 1000, _threads(before), _threads(after))
            since_beat = now - self.beat
            if since_beat > self.threshold_s:
                busy_since = busy_since or self.beat
                busy[after.get(self._loop_name, "?")] += 1
            elif busy:
                self.stalls["loop"] += 1
                top = "; ".join(f"{n}x {s}" for s, n in busy.most_common(3))
                log.warning("stall: the event loop ran no timer for %.0f ms; its stacks "
                            "meanwhile (%d samples): %s", (self.beat - busy_since) * 1000,
                            sum(busy.values()), top)
                busy.clear()
                busy_since = 0.0
            before = after
            expected = time.perf_counter() + self.tick_s


def _threads(by_name: dict[str, str]) -> str:
    return " | ".join(f"[{name}] {s}" for name, s in by_name.items())
