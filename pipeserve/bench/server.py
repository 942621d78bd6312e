"""The processes a benchmark starts: pipeserve (or a distributed launch of it), mlx_lm.server;
their ports, gauges and peak memory."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeserve.bench.config import BenchConfig
from pipeserve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]   # the checkout: serve.py, scripts/


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float, data: bytes | None = None) -> tuple[int, str]:
    """A blocking GET (or POST of `data`): (status, body)."""
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as r:
        return r.status, r.read().decode()


def _gauge(base_url: str, name: str) -> float:
    """One unlabelled sample from the server's /metrics (nan when absent)."""
    try:
        text = _get(f"{base_url}/metrics", 10)[1]
    except (OSError, urllib.error.URLError):
        return float("nan")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _state(base_url: str) -> dict[str, float]:
    """The server's memory gauges (MLX's allocator by kind, the rows' KV, the prompt cache by
    tier) in GB, what a scenario left behind and the peak so far; and the seconds its engine
    steps spent in each stage and its requests in the queue, so far (a scenario's share is the
    difference from the line before)."""
    try:
        text = _get(f"{base_url}/metrics", 10)[1]
    except (OSError, urllib.error.URLError):
        return {}
    got: dict[str, float] = {}
    scale = {"pipeserve_mlx_memory_bytes": 1e9, "pipeserve_kv_bytes": 1e9,
             "pipeserve_prompt_cache_bytes": 1e9, "pipeserve_stage_seconds_sum": 1.0,
             "pipeserve_queue_wait_seconds_sum": 1.0, "pipeserve_batch_size_count": 1.0,
             "pipeserve_memory_waits_total": 1.0,   # requests admission.memory_high_water held
             # the collector's pauses by generation (seconds, and how many)
             "pipeserve_gc_pause_seconds_sum": 1.0, "pipeserve_gc_pause_seconds_count": 1.0,
             # the admission model's terms: weights + tokens x KV per token (+ a chunk's work)
             "pipeserve_model_weight_bytes": 1e9, "pipeserve_kv_bytes_per_token": 1.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in scale:
            continue
        labels = re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]) if "{" in line else []
        label = ".".join(v for k, v in labels if k != "model")   # a pool's member: its model
        short = name.removeprefix("pipeserve_")
        short = short.replace("_bytes", "_gb") if scale[name] == 1e9 else short
        key = f"{short}.{label}".rstrip(".")
        got[key] = round(got.get(key, 0.0) + float(line.rsplit(" ", 1)[1]) / scale[name], 3)
    return got


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Process:
    """A server we start and stop by its own PID."""

    def __init__(self, args: list[str], log_path: Path, group: bool = False,
                 env: dict[str, str] | None = None, append: bool = False) -> None:
        self.log = open(log_path, "ab" if append else "wb")
        self.group = group   # mlx.launch and its ranks: a process group of their own
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=group, env=env)

    def wait_http(self, url: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if _get(url, 2)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):   # not listening yet, or not ready (503)
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{url} not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None and self.group:   # mlx.launch does not pass SIGTERM on
            os.killpg(self.proc.pid, signal.SIGTERM)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _ranks(cfg: ServeConfig, b: BenchConfig, serve: list[str], out: Path
           ) -> tuple[list[str], dict[str, str] | None, list[Process]]:
    """distributed≠none: the launcher prefix of rank 0's command, its environment, and the other
    ranks' processes (already started) for bench.launcher=env."""
    if not cfg.distributed.enabled:
        return [], None, []
    if b.launcher == "mlx.launch":
        return [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n",
                str(b.ranks)], None, []
    if b.launcher != "env":
        raise ValueError(f"bench.launcher must be mlx.launch or env, got {b.launcher!r}")
    hosts = out / "ring-hosts.json"
    base = _free_port()
    hosts.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(b.ranks)]))
    env = [{**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(r)} for r in range(b.ranks)]
    others = [Process(serve, out / f"rank{r}.log", env=env[r]) for r in range(1, b.ranks)]
    return [], env[0], others


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far (Linux /proc) of a server process and its children by role: "api
    loop" (its first thread: Sanic's event loop, single_process), "api threads" (the rest: the
    engine thread of the thread core, executors), "core process" (children: the process core).
    Time spent waiting for the GIL is not CPU time, so a share near 1.0 of the wall is a thread
    that was never off the CPU (a wait on the device counts where MLX spins on it)."""
    got = {"api loop": 0.0, "api threads": 0.0, "core process": 0.0}
    for proc in _with_children(pid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
        except OSError:
            continue
        for tid in tids:
            try:   # nanoseconds on the CPU (stat's utime and stime count 10 ms ticks)
                ns = int(Path(f"/proc/{proc}/task/{tid}/schedstat").read_text().split()[0])
            except OSError:   # the thread ended between listing and reading
                continue
            role = "core process" if proc != pid else "api loop" if tid == pid else "api threads"
            got[role] += ns / 1e9
    return got


def _with_children(pid: int) -> list[int]:
    """`pid` and its child processes (an engine core process's peak counts too), whichever of
    its threads started them (the pool starts its members from a thread of its own)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            kids += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:   # the thread ended between listing and reading
            continue
    return [pid, *kids]
