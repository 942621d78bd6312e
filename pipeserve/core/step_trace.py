"""scheduler.step_trace: one INFO line per engine pass that ran a step, with the wall clock it
began at and the milliseconds of each part, so a server's step timeline lines up with its
request lines (arrivals, first tokens) on a machine that keeps only files. Off by default."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("pipeserve.steps")


class StepTrace:
    """The engine loop marks each part as it ends; `end` logs the pass when it ran a plan:
    `step: at=<epoch s> <part>=<ms> ... rows=<n> prompt_rows=<n> tokens=<n> taken=<commands>`.
    Parts that did not run this pass (no step in flight to apply, say) are left out; those the
    loop marks in every pass (EVERY_PASS) also when they took under 0.05 ms."""

    EVERY_PASS = frozenset({"inbox", "schedule", "drain", "rest"})

    def __init__(self) -> None:
        self.wall = self.t = 0.0
        self.parts: list[tuple[str, float]] = []

    def begin(self) -> None:
        self.wall, self.t = time.time(), time.perf_counter()
        self.parts.clear()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts.append((part, now - self.t))
        self.t = now

    def end(self, rows: int, prompt_rows: int, tokens: int, taken: int) -> None:
        """`at` is when the engine had its commands: the pass began `inbox` ms before it (an
        idle engine's wait for work and for a burst's arrivals)."""
        self.mark("rest")
        at = self.wall + sum(s for name, s in self.parts if name == "inbox")
        parts = " ".join(f"{name}={s * 1000:.1f}" for name, s in self.parts
                         if s >= 5e-5 or name not in self.EVERY_PASS)
        log.info("step: at=%.4f %s rows=%d prompt_rows=%d tokens=%d taken=%d", at, parts,
                 rows, prompt_rows, tokens, taken)
