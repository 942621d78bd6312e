"""The progress line of a long launch step, as pure logic (a stand-in clock and terminal): one
line redrawn in place on a terminal, quarter lines in the log elsewhere, nothing extra for a
fast step. tests/serve/test_first_contact.py watches it through a real launch on a pty."""
from __future__ import annotations

import io
import logging

import pytest

from pipeserve.launch.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_one_line_is_redrawn_in_place_and_cleared() -> None:
    term, clock = Terminal(), Clock()
    p = StepProgress(logging.getLogger("t"), "loading m: reading the weights", 400, stream=term,
                     clock=clock)
    for _ in range(4):
        clock.now += 0.5
        p.advance(100)
    p.close()
    out = term.getvalue()
    assert "\n" not in out   # never a new line: the log's next line takes its place
    frames = [f for f in out.split("\r") if f]
    assert frames[0].startswith("loading m: reading the weights [....................]   0%")
    assert "[#####...............]  25% (100.0 of 400.0 MB, 0.5 s)" in frames[1]
    assert "[####################] 100% (400.0 of 400.0 MB, 2.0 s)" in frames[4]
    assert frames[-1] == "\x1b[K"   # cleared at the end


def test_a_terminal_is_redrawn_at_most_ten_times_a_second_but_always_at_the_end() -> None:
    term, clock = Terminal(), Clock()
    p = StepProgress(logging.getLogger("t"), "converting x.gguf", 1000, stream=term, clock=clock)
    for _ in range(1000):   # a thousand small tensors in 0.1 s
        clock.now += 0.0001
        p.advance(1)
    frames = [f for f in term.getvalue().split("\r") if f]
    assert len(frames) <= 3 and "100%" in frames[-1], frames


def test_elsewhere_a_long_step_logs_its_quarters(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    pipe = io.StringIO()
    p = StepProgress(logging.getLogger("t"), "converting x.gguf", 80, stream=pipe, clock=clock)
    with caplog.at_level(logging.INFO):
        for _ in range(8):
            clock.now += 1
            p.advance(10)
        p.close()
    assert pipe.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "converting x.gguf: 25% (20.0 of 80.0 MB, 2.0 s)",
        "converting x.gguf: 50% (40.0 of 80.0 MB, 4.0 s)",
        "converting x.gguf: 75% (60.0 of 80.0 MB, 6.0 s)",
        "converting x.gguf: 100% (80.0 of 80.0 MB, 8.0 s)"]


def test_elsewhere_a_fast_step_logs_nothing_extra(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    p = StepProgress(logging.getLogger("t"), "loading tiny: reading the weights", 0.4,
                     stream=io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO):
        clock.now += 0.01
        p.advance(0.4)
        p.close()
    assert caplog.records == []


def test_a_log_line_from_elsewhere_clears_the_bar_and_the_bar_comes_back_below_it() -> None:
    """Sanic logs "Worker ready" while the weights load: on the terminal that line must not
    land after the bar on the bar's line; the bar is cleared first and drawn again below."""
    term, clock = Terminal(), Clock()
    handler = logging.StreamHandler(term)
    other = logging.getLogger("test.progress.other")
    other.addHandler(handler)
    other.propagate = False
    try:
        p = StepProgress(logging.getLogger("t"), "converting x.gguf", 100, stream=term,
                         clock=clock)
        clock.now += 0.5
        p.advance(50)
        other.warning("Worker ready")
        clock.now += 0.01   # sooner than a redraw would be due: drawn again all the same
        p.advance(50)
        p.close()
        other.warning("converting x.gguf: done")
    finally:
        other.removeHandler(handler)
    out = term.getvalue()
    assert "%" not in out.split("Worker ready")[0].rsplit("\r\x1b[K", 1)[1]   # cleared first
    after = out.split("Worker ready\n", 1)[1]
    assert after.startswith("\rconverting x.gguf [####################] 100%")
    assert after.endswith("\x1b[K\r\x1b[Kconverting x.gguf: done\n")   # one clear at the end
