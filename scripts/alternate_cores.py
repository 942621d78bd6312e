"""Both engine core placements served at once and measured in alternation: the thread core
(the default launch) and the core process (server.isolate=true), each burst of N streaming
requests sent to one, then the same burst to the other (which goes first alternates by rep),
so a host whose speed drifts between runs (the lent H200's moves by 2x at one stream) slows
both alike. Prints one JSON line per burst, then per placement and stream count the median,
min and max of aggregate tok/s and TTFT p50, and the process core's median over the thread
core's, beside the median of each rep's own ratio (the two bursts of a rep ran back to back:
that one cancels the host's drift between reps) and how many reps each won.

    python scripts/alternate_cores.py --streams 1,32,128 --reps 5 -- model=tiny model.size=large \
        model.dtype=bfloat16 model.compute_dtype=checkpoint scheduler.max_batch=128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from http_burst import calibrate, one  # noqa: E402

PLACEMENTS = {"thread": [], "process": ["server.isolate=true"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, overrides: list[str], run_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = run_dir / f"serve-{name}.log"
    args = [sys.executable, str(ROOT / "serve.py"), f"server.port={port}",
            f"hydra.run.dir={run_dir / name}", f"server.files_dir={run_dir / name / 'files'}",
            "admission.max_queue=1024", *overrides, *PLACEMENTS[name]]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{log.name}: the server exited {proc.returncode}:\n"
                             f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{log.name}: not ready in {timeout_s:.0f} s")


async def burst(session: aiohttp.ClientSession, url: str, model: str, n: int, text: str,
                max_tokens: int, tag: str) -> dict[str, float]:
    bodies = [orjson.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "logit_bias": {"7": -100, str(11 + i % 50): 1},
        "messages": [{"role": "user", "content": f"{tag} {i} {text}"}]}) for i in range(n)]
    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(session, url, b, t0) for b in bodies))
    wall = max(g[1] for g in got)
    return {"agg_tok_s": round(sum(g[2] for g in got) / wall, 1),
            "ttft_p50_s": round(statistics.median(g[0] for g in got), 4), "wall_s": round(wall, 3)}


async def measure(urls: dict[str, str], streams: list[int], reps: int, max_tokens: int,
                  prompt_tokens: int) -> list[dict]:
    conn = aiohttp.TCPConnector(limit=max(streams) + 8)
    rows = []
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        first = next(iter(urls.values()))
        async with session.get(f"{first}/v1/models") as r:   # the served model's id
            model = (await r.json())["data"][0]["id"]
        text = await calibrate(session, first, model, prompt_tokens)
        for name, url in urls.items():   # every shape once, unmeasured
            for n in streams:
                await burst(session, url, model, n, text, 8, f"warm {name}")
        for rep in range(reps):
            for n in streams:
                order = list(urls) if rep % 2 == 0 else list(reversed(urls))
                for name in order:
                    row = {"placement": name, "streams": n, "rep": rep,
                           **await burst(session, urls[name], model, n, text, max_tokens,
                                         f"rep {rep} {name}")}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for n in sorted({r["streams"] for r in rows}):
        med: dict[str, float] = {}
        for name in PLACEMENTS:
            mine = [r for r in rows if r["streams"] == n and r["placement"] == name]
            if not mine:
                continue
            tok = [r["agg_tok_s"] for r in mine]
            ttft = [r["ttft_p50_s"] for r in mine]
            med[name] = statistics.median(tok)
            out.append({"what": "summary", "placement": name, "streams": n, "reps": len(mine),
                        "agg_tok_s_median": round(med[name], 1), "agg_tok_s_min": min(tok),
                        "agg_tok_s_max": max(tok),
                        "ttft_p50_s_median": round(statistics.median(ttft), 4),
                        "ttft_p50_s_min": min(ttft), "ttft_p50_s_max": max(ttft)})
        if len(med) == 2:
            out.append({"what": "process / thread", "streams": n,
                        "agg_tok_s_medians": round(med["process"] / med["thread"], 3),
                        **paired(rows, n)})
    return out


def paired(rows: list[dict], n: int) -> dict[str, float | int]:
    """The two placements' bursts of one rep were sent back to back, so the host's drift
    between reps moves both: the median of each rep's own ratio cancels it (the ratio of the
    medians does not), and how many reps the process core won."""
    by_rep: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r["streams"] == n:
            by_rep.setdefault(r["rep"], {})[r["placement"]] = r
    pairs = [(g["process"], g["thread"]) for g in by_rep.values() if len(g) == 2]
    if not pairs:
        return {}
    tok = [p["agg_tok_s"] / t["agg_tok_s"] for p, t in pairs]
    ttft = [p["ttft_p50_s"] / t["ttft_p50_s"] for p, t in pairs]
    return {"agg_tok_s_paired_median": round(statistics.median(tok), 3),
            "ttft_p50_s_paired_median": round(statistics.median(ttft), 3),
            "process_faster_reps": sum(x > 1 for x in tok), "paired_reps": len(pairs)}


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,32,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=76)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", default=None, help="server logs (a temporary directory)")
    args = ap.parse_args(argv[:split])
    overrides = argv[split + 1:]
    streams = [int(s) for s in args.streams.split(",")]
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="alternate-cores-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name in PLACEMENTS:   # one after the other: the first launch may generate the model
            proc, url, log = start(name, overrides, run_dir)
            servers[name] = (proc, url)
            wait_ready(proc, url, log, args.ready_timeout)
        rows = asyncio.run(measure({k: v[1] for k, v in servers.items()}, streams, args.reps,
                                   args.max_tokens, args.prompt_tokens))
        for line in summary(rows):
            print(json.dumps(line), flush=True)
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
