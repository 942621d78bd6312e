"""Inbox: the commands any thread sends the engine (submit, abort, flush, adapter swaps), taken
on the engine thread between steps, and the request counts admission reads from it."""
from __future__ import annotations

import queue
import time
from collections.abc import Iterator

from pipeserve.core.events import Command, Submit


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.num_submitted = 0    # written by submitters only
        self.num_added = 0        # engine: submits taken into the scheduler
        self.num_left_queue = 0   # engine: of those, the ones that ran or were aborted
        self.coming_at = 0.0      # when a client last opened a connection (`coming`)

    def coming(self) -> None:
        """Any thread: a request is on its way (a client opened a connection). An idle engine
        gathering a burst counts it as an arrival, so a burst's requests on new connections,
        which reach the server later than those on kept-alive ones, join its first step."""
        self.coming_at = time.monotonic()

    def put(self, cmd: Command | None) -> None:
        """Any thread. None wakes the engine (a stop)."""
        if isinstance(cmd, Submit):
            self.num_submitted += 1
        self._queue.put(cmd)

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet scheduled (in here or in the scheduler's queue)."""
        return self.num_submitted - self.num_left_queue

    def still_waiting(self, waiting: int) -> int:
        """Engine thread: `waiting` of the submits taken are still in the scheduler's queue."""
        self.num_left_queue = self.num_added - waiting
        return waiting

    def take(self, block: bool, timeout: float | None, gap: float = 0.0,
             window: float = 0.0) -> Iterator[Command]:
        """Engine thread: every command queued now, in order (waiting up to `timeout` for the
        first when `block`); ends early at a None. When it blocked and a submit woke it, it
        goes on taking what arrives until `gap` seconds passed with no command and no new
        connection (`coming`), for up to `window`."""
        until = last = None
        while True:
            wait = 0.0
            if block:
                wait = timeout
            elif until is not None:
                wait = self._quiet_until(last, gap, until) - time.monotonic()
            try:
                cmd = self._queue.get(block=wait is None or wait > 0, timeout=wait)
            except queue.Empty:
                if until is not None and self._quiet_until(last, gap, until) > time.monotonic():
                    continue   # a connection opened while it waited
                return
            if cmd is None:
                return
            if block and gap > 0 and isinstance(cmd, Submit):
                until = time.monotonic() + window
            if until is not None:
                last = time.monotonic()
            block = False
            yield cmd

    def _quiet_until(self, last: float, gap: float, until: float) -> float:
        return min(max(last, self.coming_at) + gap, until)
