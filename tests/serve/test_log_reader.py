"""End to end: a server whose log reader stops reading goes on serving. serve.py's stdout is a
pipe this test does not read (as a supervisor that stopped draining it, or a pager
left paused); before, the event loop blocked in the first log write past the pipe's buffer and
every client, /health included, waited. Real serve.py processes on 127.0.0.1; every wait is
bounded."""
from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, free_port, pinned, wait_http
from tests.serve.test_openai import metric_families

QUEUED = 40   # server.log_buffer_records: what waits for the stuck reader before drops


def complete(base: str, i: int) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7 + i % 50],
                                                   "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("core", ["thread", "process"])
def test_a_stuck_log_reader_blocks_no_client(tmp_path: Path, model_cache: Path, core: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "serve.py"), f"server.port={port}",
            f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir}",
            f"server.files_dir={tmp_path / 'files'}", f"server.log_buffer_records={QUEUED}",
            *pinned([f"server.isolate={'true' if core == 'process' else 'false'}"])]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    read: list[bytes] = []
    try:
        # the smallest pipe the kernel allows, so a few dozen request lines fill it
        size = getattr(fcntl, "F_SETPIPE_SZ", None)
        if size is not None:
            fcntl.fcntl(proc.stdout.fileno(), size, 4096)
        n = 120 if size is not None else 600
        wait_http(f"{base}/health", proc, "serve.py", lambda: "(stdout not read)", 180)
        for i in range(n):   # each writes a request line nobody reads
            complete(base, i)
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        dropped = metric_families(base)["pipeserve_log_records_dropped"].samples
        assert sum(s.value for s in dropped if s.name.endswith("_total")) > 0, dropped

        # the reader is back: the lines flow again, first a line saying what was dropped
        reader = threading.Thread(target=lambda: read.extend(iter(proc.stdout.readline, b"")),
                                  daemon=True)
        reader.start()
        complete(base, n)
        wait_for = "log records were dropped"
        for _ in range(300):
            if any(wait_for.encode() in line for line in read) and _request_lines(read) >= 1:
                break
            threading.Event().wait(0.1)
        text = b"".join(read).decode(errors="replace")
        assert wait_for in text, text[-2000:]
        assert "server.log_buffer_records" in text
    finally:
        proc.terminate()
        code = proc.wait(60)   # it stops by itself, its reader stuck or not
    assert code == 0
    # the run's log file never waited on the pipe: every request's line is in it
    log_file = run_dir / "serve.log"
    assert _request_lines(log_file.read_bytes().splitlines()) == n + 1


def _request_lines(lines: Any) -> int:
    return sum(1 for line in lines if b" - request cmpl-" in line)
