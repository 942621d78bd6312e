"""Progress of a long launch step (reading the weights, converting a GGUF's tensors, the
kernel warm-up).

On a terminal: one line rewritten in place, `what [#####.....] 52% (n of N unit, s)`, cleared
when the step ends (the step's own log line follows), and cleared too before any log line
another thread writes to a terminal meanwhile (Sanic's "Worker ready" while the weights load),
then drawn again below it. Anywhere else (a pipe, a file, a service's journal): plain log lines
at each quarter, and only once the step has run for a second, so a fast load logs nothing
extra. Called from the thread doing the step."""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 20          # characters of the bar
REDRAW_S = 0.1      # at most ten redraws a second on a terminal
QUIET_S = 1.0       # plain lines only for a step that has run this long


_LOCK = threading.Lock()   # a bar's draw and a log line's clear of it never interleave
_SHOWN: "StepProgress | None" = None   # the bar on the terminal now


class _ClearBar(logging.Filter):
    """On a handler that writes to a terminal: the bar shown there is cleared before the
    record is written, and drawn again at the step's next advance."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        with _LOCK:
            bar = _SHOWN
            if bar is not None and bar.shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                bar.shown, bar.drawn = False, float("-inf")   # drawn again at the next advance
        return True


def _watch_terminal_handlers() -> None:
    """Every handler that writes to a terminal (the root's, Sanic's own) clears a bar first."""
    loggers = [logging.getLogger()] + [x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger)]
    # a handler on its own thread (logs.own_threads) writes through its target
    for handler in {getattr(h, "target", h) for lg in loggers for h in lg.handlers}:
        stream = getattr(handler, "stream", None)
        if stream is not None and _is_terminal(stream) and not any(
                isinstance(f, _ClearBar) for f in handler.filters):
            handler.addFilter(_ClearBar(stream))


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
        self.shown = False   # the bar is on the terminal's current line
        if self.tty:
            _watch_terminal_handlers()
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
        global _SHOWN
        if self.tty:
            with _LOCK:
                if self.shown:
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
                self.shown, self.tty = False, False
                if _SHOWN is self:
                    _SHOWN = None

    def _amounts(self) -> str:
        digits = 1 if self.unit == "MB" else 0   # megabytes to a tenth; tokens, tensors whole
        return f"{self.done:.{digits}f} of {self.total:.{digits}f} {self.unit}"

    def _draw(self) -> None:
        global _SHOWN
        filled = int(WIDTH * self.done / self.total)
        bar = "#" * filled + "." * (WIDTH - filled)
        with _LOCK:
            self.stream.write(f"\r{self.what} [{bar}] {100 * self.done / self.total:3.0f}% "
                              f"({self._amounts()}, {self.clock() - self.t0:.1f} s)\x1b[K")
            self.stream.flush()
            self.shown, _SHOWN = True, self


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a closed or stand-in stream
        return False
