"""Every rank of an mlx.launch group leaves when its launcher goes away: a thread notices the
process being re-parented (the launcher died or was killed: mlx.launch forwards nothing then)
and starts the same shutdown a SIGTERM would (rank 0: drain, stop the group; the others: wait
for rank 0's stop). A rank > 0 that got SIGTERM (the launcher forwards it to every rank) waits
for rank 0's stop instead of dying mid-collective, and leaves on its own only after a bound.
Any thread; started once per process."""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
POLL_S = 0.5


def watch_launcher(on_gone: Callable[[], None]) -> None:
    """Call `on_gone` once, from a daemon thread, when this process's parent changes."""
    parent = os.getppid()
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(POLL_S):
            if os.getppid() != parent:
                log.warning("the launcher (pid %d) is gone; leaving the group", parent)
                on_gone()
                return
    threading.Thread(target=run, name="pipeserve-launcher-watch", daemon=True).start()


def stop_self() -> None:
    """Rank 0: the shutdown of a SIGTERM (drain, flush, STOP to the other ranks)."""
    os.kill(os.getpid(), signal.SIGTERM)


class FollowerExit:
    """Rank > 0: on SIGTERM or a lost launcher, wait up to `bound_s` for rank 0's stop (the
    clean leave), then exit with code 1 from a timer (`exit_now`: os._exit, never a teardown
    that could block on a collective)."""

    def __init__(self, bound_s: float, exit_now: Callable[[int], None]) -> None:
        self.bound_s, self.exit_now = bound_s, exit_now
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.leave("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self.leave("SIGINT"))
        watch_launcher(lambda: self.leave("launcher gone"))

    def leave(self, why: str) -> None:
        with self._lock:
            if self._timer is not None:
                return
            log.info("%s: waiting up to %.0f s for rank 0 to stop the group", why, self.bound_s)
            self._timer = threading.Timer(self.bound_s, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        log.error("rank 0 did not stop the group within %.0f s; leaving it", self.bound_s)
        self.exit_now(1)
