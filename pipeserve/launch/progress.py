"""Progress of a long launch step (reading the weights, converting a GGUF's tensors, the
kernel warm-up).

On a terminal: one line rewritten in place, `what [#####.....] 52% (n of N unit, s)`, cleared
when the step ends (the step's own log line follows). Anywhere else (a pipe, a file, a
service's journal): plain log lines at each quarter, and only once the step has run for a
second, so a fast load logs nothing extra. Called from the thread doing the step."""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 20          # characters of the bar
REDRAW_S = 0.1      # at most ten redraws a second on a terminal
QUIET_S = 1.0       # plain lines only for a step that has run this long


class StepProgress:
    def __init__(self, log: logging.Logger, what: str, total: float, unit: str = "MB",
                 stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.what, self.total, self.unit = log, what, max(total, 1e-9), unit
        self.stream = stream if stream is not None else sys.stdout
        self.tty = _is_terminal(self.stream)
        self.clock = clock
        self.t0 = self.drawn = clock()
        self.done = 0.0
        self.quarter = 0
        if self.tty:
            self._draw()

    def advance(self, amount: float) -> None:
        self.done = min(self.total, self.done + amount)
        now = self.clock()
        if self.tty:
            if now - self.drawn >= REDRAW_S or self.done >= self.total:
                self.drawn = now
                self._draw()
            return
        quarter = int(4 * self.done / self.total)
        if quarter > self.quarter and now - self.t0 >= QUIET_S:
            self.log.info("%s: %d%% (%s, %.1f s)", self.what, 25 * quarter, self._amounts(),
                          now - self.t0)
        self.quarter = max(self.quarter, quarter)

    def close(self) -> None:
        """The step ended (or failed): a terminal's line is cleared for the next log line."""
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.tty = False

    def _amounts(self) -> str:
        digits = 1 if self.unit == "MB" else 0   # megabytes to a tenth; tokens, tensors whole
        return f"{self.done:.{digits}f} of {self.total:.{digits}f} {self.unit}"

    def _draw(self) -> None:
        filled = int(WIDTH * self.done / self.total)
        bar = "#" * filled + "." * (WIDTH - filled)
        self.stream.write(f"\r{self.what} [{bar}] {100 * self.done / self.total:3.0f}% "
                          f"({self._amounts()}, {self.clock() - self.t0:.1f} s)\x1b[K")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a closed or stand-in stream
        return False
