"""The log handlers' own threads (pipeserve/launch/logs.py own_threads): a line goes out at once
while its reader keeps up, waits while the reader is stuck (the logging thread returns), is
dropped past the bound and said so, and a traceback survives the wait in both formats. A real
pipe as the reader; every wait is bounded."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator

import pytest

from pipeserve.launch import logs


@pytest.fixture
def pipe_logger() -> Iterator[tuple[logging.Logger, int, logging.StreamHandler]]:
    """The root logger writing only to a small pipe whose read end the test holds."""
    read, write = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(read, False)
    stream = os.fdopen(write, "w", buffering=1)
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logs.own_threads(capacity=8)
    try:
        yield logging.getLogger("pipeserve.test"), read, handler
    finally:
        assert logs.stop_threads(timeout_s=0.5) in (True, False)
        root.handlers[:] = saved
        root.setLevel(level)
        stream.close()
        os.close(read)


def drain(fd: int, done: Callable[[str], bool], timeout_s: float = 20.0) -> str:
    """Read what the pipe holds until `done(what was read)` (bounded)."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            chunk = b""
        got += chunk
        if done(got.decode(errors="replace")):
            break
        if not chunk:
            time.sleep(0.01)
    return got.decode()


def test_a_line_goes_out_at_once_while_the_reader_keeps_up(pipe_logger) -> None:
    log, read, _ = pipe_logger
    log.info("hello %s", "there")
    # written on this thread before info() returned: no wait for another thread
    assert os.read(read, 4096).decode() == "hello there\n"


def test_a_stuck_reader_holds_no_thread_and_hears_what_it_missed(pipe_logger) -> None:
    log, read, handler = pipe_logger
    handler.setFormatter(logs.JsonFormatter())
    line = "x" * 200
    t0 = time.monotonic()
    for i in range(200):   # 4 KB of pipe, then 8 waiting, then dropped
        log.info("%d %s", i, line)
    assert time.monotonic() - t0 < 30   # it returned: no write blocked this thread
    queued = logs._queued[0][0]
    assert queued.dropped > 0
    # the reader is back: what waited is written
    text = drain(read, lambda got: "log records were dropped" in got and not queued.pending)
    try:   # a traceback goes by the queue, and is rendered there
        raise KeyError("second cause")
    except KeyError:
        log.exception("failed here")
    text += drain(read, lambda got: "second cause" in got)
    dropped = queued.dropped
    records = [json.loads(x) for x in text.splitlines()]
    # a line (or more: the handler's thread may catch up between drops) says how many it missed
    warned = [r for r in records if "log records were dropped" in r["msg"]]
    assert warned and all(r["level"] == "WARNING" for r in warned)
    assert sum(int(r["msg"].split()[0]) for r in warned) == dropped
    last = [r for r in records if r["msg"] == "failed here"][-1]
    assert "KeyError: 'second cause'" in last["exc"]   # the traceback, rendered when queued
    numbers = [int(r["msg"].split()[0]) for r in records if r["level"] == "INFO"]
    assert numbers[0] == 0 and numbers == sorted(numbers)   # what was written kept its order
    assert len(numbers) + dropped == 200   # every line written, or counted as dropped
