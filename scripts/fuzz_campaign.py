"""The closing measurement of issue 15, against a real server on 127.0.0.1 (bounded):

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


def fuzz_run(args: argparse.Namespace, base_url: str, results: dict[str, Any]) -> None:
    health = HealthProcess(base_url)
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
    ap.add_argument("overrides", nargs="*", default=["model=tiny", "scheduler=continuous",
                                                     "cache=ram"],
                    help="serve.py overrides for a started server")
    args = ap.parse_args()
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
    f = results.get("fuzz")
    bad = f is not None and (f["num_5xx"] or f["problems"] or f["bystander"]["failures"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
