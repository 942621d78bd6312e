"""The closing measurement of issues 15 and 34, against a real server on 127.0.0.1 (bounded):

1. a fuzz run: tests/serve/test_fuzz.py's generators, `--per-endpoint` bodies for each of the six
   endpoint groups (3,000+ requests by default), sent from 4 threads beside a greedy bystander
   stream (its every run must equal its solo run) and a /health poller in its own process (so
   the client's own threads never delay it);
2. a cancel storm: `--storm` streams (max_tokens=2000) dropped after 20 tokens, 8 at a time,
   with MLX active memory, the prompt cache's bytes, the running rows' bytes and the server's RSS
   read before and after.

    python scripts/fuzz_campaign.py                      # starts serve.py (model=tiny)
    python scripts/fuzz_campaign.py --url http://127.0.0.1:8080 --pid 1234
    python scripts/fuzz_campaign.py --per-endpoint 100 --storm 60 --json out.json
    python scripts/fuzz_campaign.py --pool --per-endpoint 60 --storm 0   # a pool

With --pool the server is `serve.py pool=example` (two generated models, each engine in its own
process): the fuzzed bodies name one of the pool's ids (or, as drawn, something else), the
bystander streams from a pool model, and an admin stream runs beside them the whole time —
concurrent cache flushes, /metrics scrapes, adapter mount/unmount (501 on a pool), /v1/models
and /health — every one of which must be answered (a timeout is a lost reply), none with a 5xx
other than the 501 that refuses adapter swaps on a pool.

Prints a summary (statuses, every contract breach with its body, bystander failures, the worst
/health latency, memory before/after) and exits 1 if any 5xx, breach or bystander failure."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serve import test_cache_memory as storms  # noqa: E402
from tests.serve import test_fuzz as fz  # noqa: E402


def poll_health(base_url: str, interval_s: float, stop: Any, out: Any) -> None:
    """Child process: GET /health every `interval_s` until `stop`; send back latencies."""
    lat: list[float] = []
    slow: list[tuple[float, float]] = []   # (latency, wall time sent), the 10 slowest
    failures: list[str] = []
    with httpx.Client(base_url=base_url) as client:
        out.send("ready")
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = client.get("/health", timeout=30)
                if r.status_code != 200:
                    failures.append(f"/health {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(f"/health: {e!r}")
            lat.append(time.perf_counter() - t0)
            slow.append((lat[-1], time.time() - lat[-1]))
            slow = sorted(slow, reverse=True)[:10]
            stop.wait(interval_s)
    out.send({"polls": len(lat), "worst_s": max(lat, default=0.0),
              "p99_s": sorted(lat)[int(0.99 * (len(lat) - 1))] if lat else 0.0,
              "p50_s": sorted(lat)[len(lat) // 2] if lat else 0.0, "failures": failures[:20],
              "num_failures": len(failures), "slowest": slow})


class HealthProcess:
    def __init__(self, base_url: str, interval_s: float = 0.05) -> None:
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=poll_health, args=(base_url, interval_s, self.stop, send),
                                daemon=True)
        self.proc.start()
        if not (self.recv.poll(120) and self.recv.recv() == "ready"):
            raise RuntimeError("the /health poller process did not start")

    def result(self) -> dict[str, Any]:
        self.stop.set()
        got = self.recv.recv() if self.recv.poll(60) else {"error": "poller did not answer"}
        self.proc.join(10)
        return got


def rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def start_server(overrides: list[str], model_cache: str | None) -> tuple[subprocess.Popen, str, Path]:
    from tests.conftest import free_port, wait_http
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="fuzz-campaign-"))
    log_path = run_dir / "serve.log"
    args = [sys.executable, str(ROOT / "serve.py"), f"server.port={port}",
            f"hydra.run.dir={run_dir / 'run'}", *overrides]
    if model_cache:
        args.append(f"model.cache_dir={model_cache}")
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    wait_http(f"{base_url}/health", proc, "serve.py", lambda: log_path.read_text(errors="replace"),
              300)
    return proc, base_url, log_path


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def memory(base_url: str, pid: int | None) -> dict[str, Any]:
    m = storms.memory(base_url)
    return {"mlx_active_mb": round(m["active"] / 1e6, 2), "cache_mb": round(m["cache"] / 1e6, 2),
            "rows_mb": round(m["rows"] / 1e6, 2), "entries": int(m["entries"]),
            "evictions": int(m["evictions"]),
            "rss_mb": round(rss(pid) / 1e6, 1) if pid is not None else None}


POOL_IDS = ("tiny-qwen3", "tiny-llama")
ADMIN_CALLS = [("POST", "/admin/cache/flush", None), ("GET", "/metrics", None),
               ("POST", "/v1/adapters", {"id": "lora"}), ("POST", "/v1/adapters", {"id": "a" * 300}),
               ("DELETE", "/v1/adapters/lora", None), ("GET", "/v1/models", None),
               ("GET", "/v1/adapters", None), ("GET", "/health", None)]


def on_pool(models: tuple[str, ...]) -> None:
    """Point the fuzzer at a pool: the bystander streams from its first model, and a body
    naming the single-model id `tiny` names one of the pool's ids instead (chosen by its
    bytes, so a run with --seed sends the same bodies)."""
    fz.BYSTANDER = {**fz.BYSTANDER, "model": models[0]}
    plain_send = fz.send

    def send(client: httpx.Client, call: Any, timeout_s: float = 60.0) -> Any:
        if call.body is not None and b'"tiny"' in call.body:
            model = models[sum(call.body) % len(models)]
            call.body = call.body.replace(b'"tiny"', f'"{model}"'.encode())
        return plain_send(client, call, timeout_s)
    fz.send = send


class AdminTraffic:
    """A thread that sends ADMIN_CALLS, four at a time, until stopped; counts statuses, lost
    replies (timeouts, resets) and the slowest answer per route."""

    def __init__(self, base_url: str, timeout_s: float = 60.0) -> None:
        import threading
        self.base_url, self.timeout_s = base_url, timeout_s
        self.stop = threading.Event()
        self.statuses: Counter[str] = Counter()
        self.lost: list[str] = []
        self.slowest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(4)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.base_url) as client:
            i = k
            while not self.stop.is_set():
                method, path, body = ADMIN_CALLS[i % len(ADMIN_CALLS)]
                i += 3
                t0 = time.perf_counter()
                try:
                    r = client.request(method, path, json=body, timeout=self.timeout_s)
                    key = f"{method} {path[:30]} {r.status_code}"
                except httpx.HTTPError as e:
                    with self._lock:
                        self.lost.append(f"{method} {path[:30]}: {e!r}")
                    continue
                took = time.perf_counter() - t0
                with self._lock:
                    self.statuses[key] += 1
                    route = f"{method} {path[:30]}"
                    self.slowest[route] = max(self.slowest.get(route, 0.0), took)
                self.stop.wait(0.02)

    def result(self) -> dict[str, Any]:
        self.stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        return {"statuses": dict(sorted(self.statuses.items())), "lost": self.lost[:20],
                "num_lost": len(self.lost),
                # 501 is the designed answer to adapter swaps on a pool, not a fault
                "num_5xx": sum(v for k, v in self.statuses.items()
                               if k.rsplit(" ", 1)[1].startswith("5") and not k.endswith(" 501")),
                "slowest_s": {k: round(v, 3) for k, v in sorted(self.slowest.items())}}


def fuzz_run(args: argparse.Namespace, base_url: str, results: dict[str, Any]) -> None:
    health = HealthProcess(base_url)
    admin = AdminTraffic(base_url) if args.pool else None
    if admin is not None:
        admin.start()
    t0 = time.monotonic()
    campaign = fz.fuzz(base_url, args.per_endpoint, args.seconds, seed=args.seed)
    results["fuzz"] = {
        "calls": len(campaign.outcomes), "seconds": round(campaign.seconds, 1),
        "statuses": {str(k): v for k, v in sorted(campaign.statuses().items())},
        "by_endpoint": {e: dict(Counter(str(o.status) for o in campaign.outcomes
                                        if o.call.endpoint == e)) for e in fz.ENDPOINTS},
        "num_5xx": sum(v for k, v in campaign.statuses().items() if k >= 500),
        "problems": [{"endpoint": o.call.endpoint, "status": o.status, "problem": o.problem,
                      "call": o.call.show(600)} for o in campaign.problems()],
        "bystander": {"runs": campaign.bystander.runs,
                      "failures": len(campaign.bystander.failures),
                      "first_failures": campaign.bystander.failures[:10]},
        "health": health.result(),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if admin is not None:
        results["admin"] = admin.result()
        a = results["admin"]
        print(f"admin traffic beside it: {sum(a['statuses'].values())} answered, "
              f"{a['num_lost']} lost, {a['num_5xx']} x 5xx", flush=True)
        for key, n in a["statuses"].items():
            print(f"  {key}: {n}", flush=True)
        print(f"  slowest: {a['slowest_s']}", flush=True)
    print(fz.report(campaign), flush=True)
    # the calls in flight while each of the slowest /health polls waited
    for lat, sent in results["fuzz"]["health"].get("slowest", [])[:5]:
        busy = [o for o in campaign.outcomes
                if o.started <= sent + lat and o.started + o.seconds >= sent]
        print(f"/health {lat * 1e3:.0f} ms at {sent:.2f}; in flight: " + "; ".join(
            f"{o.call.endpoint}/{o.status} {o.seconds:.2f}s {len(o.call.body or b'')}B"
            for o in busy[:6]), flush=True)
    h = results["fuzz"]["health"]
    print(f"/health (own process): {h.get('polls')} polls, worst {h.get('worst_s', 0) * 1e3:.1f}"
          f" ms, p99 {h.get('p99_s', 0) * 1e3:.1f} ms, {h.get('num_failures')} failures",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="an already running server (else serve.py is started)")
    ap.add_argument("--pid", type=int, help="its PID, to read RSS (with --url)")
    ap.add_argument("--per-endpoint", type=int, default=550, help="bodies per endpoint group (6)")
    ap.add_argument("--seconds", type=float, default=900, help="cap on the fuzz run's sending")
    ap.add_argument("--storm", type=int, default=500, help="streams in the cancel storm")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (reproducible run)")
    ap.add_argument("--model-cache", default=None, help="model.cache_dir for a started server")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--pool", action="store_true",
                    help="fuzz `serve.py pool=example` with admin traffic beside")
    ap.add_argument("overrides", nargs="*", default=None,
                    help="serve.py overrides for a started server")
    args = ap.parse_args()
    if args.overrides is None or not args.overrides:
        args.overrides = (["pool=example", "scheduler=continuous", "cache=ram"] if args.pool
                          else ["model=tiny", "scheduler=continuous", "cache=ram"])
    if args.pool:
        on_pool(POOL_IDS)
    proc = None
    if args.url:
        base_url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, base_url, log_path = start_server(args.overrides, args.model_cache)
        pid = proc.pid
        print(f"serve.py pid {pid} at {base_url}, log {log_path}", flush=True)
    results: dict[str, Any] = {"url": base_url}
    try:
        if args.per_endpoint > 0:
            fuzz_run(args, base_url, results)
        if args.storm:
            storms.settled(base_url)
            before = memory(base_url, pid)
            t1 = time.monotonic()
            got = storms.storm(base_url, args.storm) if args.storm <= 200 else [
                n for k in range(0, args.storm, 100)
                for n in storms.storm(base_url, min(100, args.storm - k), first=k)]
            storms.settled(base_url)
            after = memory(base_url, pid)
            results["storm"] = {"streams": len(got), "cut_at_20": sum(n == storms.CUT for n in got),
                                "seconds": round(time.monotonic() - t1, 1),
                                "before": before, "after": after}
            print(f"cancel storm: {len(got)} streams dropped after {storms.CUT} tokens in "
                  f"{results['storm']['seconds']} s\n  before {before}\n  after  {after}",
                  flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    f, a = results.get("fuzz"), results.get("admin")
    bad = f is not None and (f["num_5xx"] or f["problems"] or f["bystander"]["failures"])
    bad = bad or (a is not None and (a["num_lost"] or a["num_5xx"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
