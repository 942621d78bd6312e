"""server.stall_report_ms's watchdog on a real event loop: a callback that keeps the loop busy
is reported with the loop's stack while it was busy; a C call that holds the GIL is reported
with where the threads were around it; a quiet loop reports nothing."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from pipeserve.errors import ConfigError
from pipeserve.http.config import ServerConfig
from pipeserve.launch.stalls import StallWatch


def _run_loop(work, threshold_s: float = 0.05) -> StallWatch:
    """A loop in its own thread, the watch started on it, `work` run on it once, then the loop
    left idle for a while and stopped."""
    box: dict[str, StallWatch] = {}
    started = threading.Event()

    def main() -> None:
        async def go() -> None:
            box["w"] = StallWatch(asyncio.get_running_loop(), threshold_s).start()
            started.set()
            await asyncio.sleep(0.1)
            work()
            await asyncio.sleep(0.3)   # beats again: the stall is logged
            box["w"].stop()
        asyncio.run(go())
    t = threading.Thread(target=main)
    t.start()
    t.join()
    assert started.is_set()
    return box["w"]


def busy_python_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_loop_is_reported_with_what_it_was_running(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pipeserve.stalls")
    w = _run_loop(lambda: busy_python_for(0.4))
    assert w.stalls["loop"] >= 1
    lines = [r.getMessage() for r in caplog.records if "event loop ran no timer" in r.getMessage()]
    assert lines and any("busy_python_for" in line for line in lines)


def test_a_c_call_holding_the_gil_is_reported(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pipeserve.stalls")
    w = _run_loop(lambda: sum(range(60_000_000)))   # one C call: the GIL is never let go
    assert w.stalls["gil"] >= 1
    line = next(r.getMessage() for r in caplog.records
                if "no Python thread ran" in r.getMessage())
    assert "test_stalls.py" in line   # the lambda's caller, before or after


def test_a_quiet_loop_reports_nothing(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pipeserve.stalls")
    w = _run_loop(lambda: None, threshold_s=5.0)
    assert w.stalls == {"gil": 0, "loop": 0}
    assert not [r for r in caplog.records if r.name == "pipeserve.stalls"]


def test_a_negative_threshold_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"server.stall_report_ms must be >= 0.*-1"):
        ServerConfig(stall_report_ms=-1)
