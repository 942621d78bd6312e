"""An idle engine gathers a burst (scheduler.arrival_gap_ms): it takes arrivals until none came
for the gap. A client opening a connection counts as an arrival, so a burst's requests on new
connections (which reach the server later than those on kept-alive ones) join its first step.
Real server, raw HTTP on 127.0.0.1, the engine's step trace read from its log.

The gap is a second here, and the events are spaced by 0.4 s or more on either side of it, so a
loaded machine's delays do not change which step a request lands in."""
from __future__ import annotations

import re
import socket
import time
from typing import Any

import orjson
import pytest

STEP = re.compile(r"step: at=[\d.]+ .*? rows=(\d+) prompt_rows=(\d+) tokens=\d+ taken=\d+")


def post(port: int, ids: list[int]) -> bytes:
    body = orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0})
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def answer(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def first_step(log: str, after: int) -> tuple[int, int]:
    """(rows, prompt rows) of the first step logged past `after` characters."""
    m = STEP.search(log, after)
    assert m, log[after:][-3000:]
    return int(m[1]), int(m[2])


@pytest.fixture(scope="module", params=["thread", "process"])
def gathering(request: Any, server_factory: Any) -> Any:
    """Both engine placements: the process core's hint crosses the pipe to its engine."""
    return server_factory("scheduler.step_trace=true", "scheduler.arrival_gap_ms=1000",
                          "scheduler.arrival_window_ms=8000", "cache=off",
                          f"server.isolate={request.param == 'process'}")


@pytest.mark.parametrize("opened_early", [True, False])
def test_a_connection_opened_in_the_gap_holds_the_first_step(gathering: Any,
                                                               opened_early: bool) -> None:
    """A at 0; a connection opened at 0.8 s (its request sent at 1.4 s): the gap runs from the
    connection, so B is in A's first step. Opened with its request at 1.4 s instead, past A's
    gap: A's step has already started alone."""
    port = gathering.port
    seen = len(gathering.log())
    a = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    a.sendall(post(port, [11, 12, 13, 14, 15, 16]))
    b = None
    if opened_early:
        time.sleep(max(0.0, 0.8 - (time.monotonic() - t0)))
        b = socket.create_connection(("127.0.0.1", port))
    time.sleep(max(0.0, 1.4 - (time.monotonic() - t0)))
    if b is None:
        b = socket.create_connection(("127.0.0.1", port))
    b.sendall(post(port, [21, 22, 23, 24, 25, 26, 27]))
    got = [answer(a), answer(b)]
    assert all(g.startswith(b"HTTP/1.1 200") for g in got), got
    rows, prompts = first_step(gathering.log(), seen)
    assert (rows, prompts) == ((2, 2) if opened_early else (1, 1))
