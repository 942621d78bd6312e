"""A burst of new clients while the event loop is busy is queued by the kernel, not dropped:
server.backlog (2048 by default) is the listen backlog. The server process is stopped
(SIGSTOP, its own PID) so nothing accepts, 300 clients connect to 127.0.0.1, and every one
completes its handshake; with server.backlog=100 (Sanic's own default) a third of them cannot,
and would retry a second later. Then the server goes on and answers."""
from __future__ import annotations

import os
import select
import signal
import socket
import time
from typing import Any

import httpx
import pytest

CLIENTS = 300


def connected_while_stopped(port: int, pid: int) -> int:
    """How many of CLIENTS non-blocking connects complete while the server is stopped."""
    socks = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(CLIENTS):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        time.sleep(0.3)   # loopback handshakes complete at once; a dropped SYN retries in 1 s
        _, writable, _ = select.select([], socks, [], 0.2)
        return sum(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in writable)
    finally:
        for s in socks:
            s.close()
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("backlog", [None, 100])
def test_a_burst_of_connects_to_a_busy_server_is_queued(server_factory: Any,
                                                        backlog: int | None) -> None:
    s = server_factory(*([f"server.backlog={backlog}"] if backlog else []))
    n = connected_while_stopped(s.port, s.proc.pid)
    if backlog is None:
        assert n == CLIENTS
    else:
        assert n < CLIENTS * 0.8, n   # the kernel's queue is full at the backlog
    r = httpx.get(f"{s.base_url}/health", timeout=30)
    assert r.status_code == 200
