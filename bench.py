"""bench.py: fixed client workloads against pipeserve started with the given config, optionally
side by side with mlx_lm.server and the bare mlx-lm decode loop on the same model directory.
Writes a Markdown and CSV table (one row per target) under bench.out, new each run; the jobs of
one -m sweep add to one table. Needs the bench extra: pip install -e '.[bench]'.

    python bench.py                                     # single stream, small bf16 model
    python bench.py bench.streams=16 bench.mlx_lm=true bench.bare_loop=false
"""
from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

try:
    import aiohttp
except ImportError:   # the base install has no bench client
    sys.exit("bench.py needs the bench extra (aiohttp, its client; matplotlib, its plots): "
             "pip install -e '.[bench]'")
import hydra
import orjson
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import ServeConfig, load_config, register_configs

ROOT = Path(__file__).resolve().parent
# The generated models' EOS ids; suppressed so every stream runs to max_tokens.
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jumbled figures near the old river bank and count every small stone").split()


@dataclass
class BenchConfig:
    workload: str = "single"        # single | concurrent (mixed lengths) | shared_prefix |
    #                                 distinct (long prompts sharing nothing) | cache_ttft |
    #                                 copy (asks to repeat a prose passage) |
    #                                 repetitive (one short sentence repeated: n-gram lookup hits) |
    #                                 steps (no server: one forward per step shape, timed) |
    #                                 vision (chat requests, an image per stream; model=tiny_vlm
    #                                 or a VLM's model.path; bench.mlx_lm=true: mlx-vlm's generate)
    streams: int = 1                # concurrent client streams
    requests_per_stream: int = 1    # requests each stream sends back to back
    prompt_words: int = 48          # words per prompt (≈ 64 tokens); concurrent mixes 0.5×–2×
    max_tokens: int = 128           # output tokens per request (EOS suppressed)
    mlx_lm: bool = False            # also run mlx_lm.server on the same model and load
    bare_loop: bool = True          # also time the bare mlx-lm decode loop (single stream ceiling)
    batch_generator: bool = False   # also run the same prompts through mlx-lm's BatchGenerator
    #                                 (the library, no server: the batched ceiling)
    engine_alone: bool = False      # also drive pipeserve's engine with no HTTP (scripts/
    #                                 engine_alone.py: Engine.submit + RequestStreams, the same
    #                                 overrides, prompt length and output, EOS suppressed), so a
    #                                 loss is attributed to the engine or to the HTTP side
    warmup: bool = True             # one short request per target before timing
    out: str = "bench-out"          # directory for results.md / results.csv
    timeout_s: float = 1800         # per target
    prompt_file: str | None = None  # use this file's text as every prompt (overrides workload text)
    step_context: int = 1024        # workload=steps: tokens already in the cache
    step_width: int = 8             # workload=steps: tokens per row in a verify-shaped forward
    adapters: int = 0               # N random LoRA adapters (rank 8, q/v of every layer) mounted
    #                                 at launch; request i asks for adapter i mod N (model
    #                                 "<name>:<id>"); 0 = the base model
    ranks: int = 2                  # distributed≠none: ranks on this host for the pipeserve target
    launcher: str = "mlx.launch"    # distributed≠none: `mlx.launch --backend ring` (as users
    #                                 launch), or `env`: bench starts each rank itself with the
    #                                 MLX_HOSTFILE / MLX_RANK that mlx.launch would give it (no
    #                                 launcher process: mlx.launch's output relay spins a core)


@dataclass
class Row:
    target: str
    workload: str
    streams: int
    requests: int
    output_tokens: int
    wall_s: float
    agg_tok_s: float
    stream_tok_s_p50: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_ms: float
    itl_p95_ms: float
    peak_rss_mb: float
    overrides: str = ""
    prompt_tokens: float = float("nan")     # mean usage.prompt_tokens
    prefill_tok_s: float = float("nan")     # mean prompt_tokens / TTFT (B=1: the prefill rate)
    decode_agg_tok_s: float = float("nan")  # tokens after the first / (last end - first token)
    spec_proposed: int = 0                  # sum of usage.speculation.proposed (timed requests)
    spec_accepted: int = 0
    acceptance: float = float("nan")        # accepted / proposed
    kv_bytes_per_token: float = float("nan")  # the server's pipeserve_kv_bytes_per_token gauge
    errors: int = 0                         # requests the server failed (error event)
    decode_full_tok_s: float = float("nan")  # all streams' tokens while every stream decodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _words(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + j) % len(WORDS)] for j in range(n))


REPEATED = "The cat sat on the mat and looked at the door. "


def _prompts(b: BenchConfig, salt: str = "") -> list[str]:
    """One prompt per request. `salt` makes a set that shares no prefix with the real one
    (the warm-up uses it, so prompt caches start cold)."""
    out = []
    fixed = Path(b.prompt_file).expanduser().read_text() if b.prompt_file else None
    for i in range(b.streams * b.requests_per_stream):
        n = b.prompt_words
        if fixed is not None:
            text = fixed
        elif b.workload == "copy":            # a long passage to repeat verbatim
            from pipeline.tiny import CORPUS
            words = CORPUS.split()
            passage = " ".join(words[(i * 17 + j) % len(words)] for j in range(n))
            text = f"Repeat the following passage exactly, word for word.\n\n{passage}\n\nRepeated:\n"
        elif b.workload == "repetitive":      # the prompt repeats itself: n-gram lookup can hit
            reps = max(1, n // len(REPEATED.split()))
            text = f"{i}: " + REPEATED * reps
        elif b.workload == "concurrent":
            text = _words(max(4, int(n * (0.5, 1.0, 2.0, 1.5)[i % 4])), i)
        elif b.workload == "shared_prefix":   # N agents, one long system prompt
            text = f"{_words(n, 0)} question {i}: {_words(8, 3 * i + 1)}"
        elif b.workload == "distinct":        # N long prompts sharing nothing
            text = f"document {i}: {_words(n, 7 * i + 1)}"
        else:
            text = _words(n, i)
        out.append(f"{salt} {text}" if salt else text)
    return out


async def _one(client: aiohttp.ClientSession, url: str, model: str, prompt: str,
               max_tokens: int, eos_bias: dict[str, float], attempts: int = 5) -> dict[str, Any]:
    """One streaming request; a connection refused or reset before any response byte is
    retried (a server with a short listen backlog drops bursts of connects)."""
    for attempt in range(attempts):
        try:
            return await _one_try(client, url, model, prompt, max_tokens, eos_bias)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


async def _one_try(client: aiohttp.ClientSession, url: str, model: str, prompt: str,
                   max_tokens: int, eos_bias: dict[str, float]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": eos_bias}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    usage: dict[str, Any] = {}
    end = float("nan")
    async with client.post(url, data=orjson.dumps(body),
                           headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:   # the server's own error names the field and the limit
            raise SystemExit(f"bench: {url} answered {r.status}: {(await r.text())[:500]}")
        async for line in r.content:   # SSE, one line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("error"):   # the server failed this request: counted, not timed
                return {"t0": t0, "stamps": [], "tokens": 0, "end": float("nan"),
                        "prompt_tokens": None, "speculation": None, "error": chunk["error"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
                usage_tokens = usage.get("completion_tokens")
            for ch in chunk.get("choices") or []:
                if ch.get("finish_reason"):
                    end = now
                elif ch.get("text") is not None:
                    stamps.append(now)   # one chunk per token (text may be empty)
    n = usage_tokens if usage_tokens is not None else len(stamps)
    return {"t0": t0, "stamps": stamps, "tokens": n, "end": end,
            "prompt_tokens": usage.get("prompt_tokens"), "speculation": usage.get("speculation")}


def _full_batch_rate(results: list[dict[str, Any]], b: BenchConfig) -> float:
    """Batched decode rate with every stream decoding: the tokens all streams received between
    the last stream's first token and the first stream's end, over that window. Unlike
    decode_agg it leaves out steps that also prefilled someone's prompt. Counted in chunks, one
    per token, so it is nan when speculation (several tokens per chunk) took part, and when the
    window holds fewer than two tokens per stream."""
    firsts = results[::b.requests_per_stream]   # each stream's first request
    if any(not r["stamps"] or r["end"] != r["end"] or (r.get("speculation") or {}).get("accepted")
           for r in results):
        return float("nan")
    w0 = max(r["stamps"][0] for r in firsts)
    w1 = min(r["end"] for r in firsts)
    n = sum(1 for r in results for t in r["stamps"] if w0 < t <= w1)
    return n / (w1 - w0) if w1 > w0 and n >= 2 * b.streams else float("nan")


async def drive(base_url: str, model: str, b: BenchConfig, eos_bias: dict[str, float],
                adapters: list[str] | None = None) -> dict[str, Any]:
    prompts = _prompts(b)
    base_model = model

    def model_of(i: int) -> str:   # request i's model id: the base, or "<base>:<adapter>"
        return f"{base_model}:{adapters[i % len(adapters)]}" if adapters else base_model

    url = f"{base_url}/v1/completions"
    # aiohttp, one kept-alive connection per stream. The client must not be what is measured:
    # httpx's pool rescans every connection for every queued request, so at 128 streams it
    # spent ~70% of this process's CPU there and issued one burst over 2.3 s on this 2-core
    # CPU (TTFT p50 1.4 s, against 0.2 s with this client); its per-chunk stack also cost ~3×
    async with _session(b.streams, b.timeout_s) as client:
        if b.warmup:   # compile kernels for these shapes (GPU JIT) before timing
            warm = _prompts(b, salt="warm-up")
            await _one(client, url, model_of(0), warm[0], b.max_tokens, eos_bias)
            await asyncio.gather(*(_one(client, url, model_of(i), p, 16, eos_bias)
                                   for i, p in enumerate(warm[:b.streams])))

        total = b.streams * b.requests_per_stream
        done = 0

        async def stream(k: int) -> list[dict[str, Any]]:
            nonlocal done
            out = []
            for j in range(b.requests_per_stream):
                i = k * b.requests_per_stream + j
                out.append(await _one(client, url, model_of(i), prompts[i], b.max_tokens,
                                      eos_bias))
                done += 1
                if done % max(1, total // 10) == 0 or done == total:
                    print(f"bench: {done}/{total} requests, {time.perf_counter() - t0:.1f} s",
                          flush=True)
            return out
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(k) for k in range(b.streams)))
                   for r in rs]
        wall = time.perf_counter() - t0
    failed = [r["error"] for r in results if r.get("error")]
    if failed:
        print(f"bench: {len(failed)} of {len(results)} requests FAILED, e.g. {failed[0]}",
              flush=True)
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [(y - x) * 1000 for r in results for x, y in zip(r["stamps"], r["stamps"][1:])]
    # decode rate of a stream: tokens after the first over the time from the first to the end
    per_stream = [(r["tokens"] - 1) / (r["end"] - r["stamps"][0])
                  for r in results if r["stamps"] and r["end"] > r["stamps"][0]]
    tokens = sum(r["tokens"] for r in results)
    timed = [r for r in results if r["stamps"] and r["end"] == r["end"]]
    span = (max(r["end"] for r in timed) - min(r["stamps"][0] for r in timed)) if timed else 0.0
    decode_agg = sum(r["tokens"] - 1 for r in timed) / span if span > 0 else float("nan")
    decode_full = _full_batch_rate(results, b)
    ptoks = [r["prompt_tokens"] for r in results if r["prompt_tokens"] is not None]
    prefill = [r["prompt_tokens"] / (r["stamps"][0] - r["t0"]) for r in results
               if r["prompt_tokens"] is not None and r["stamps"]]
    specs = [r["speculation"] for r in results if r["speculation"]]
    per_request = [{"start_s": r["t0"] - t0, "ttft_s": r["stamps"][0] - r["t0"],
                    "latency_s": r["end"] - r["t0"], "tokens": r["tokens"]}
                   for r in results if r["stamps"] and r["end"] == r["end"]]
    return {"per_request": per_request, "requests": len(results), "errors": len(failed), "tokens": tokens, "wall": wall, "ttft": ttft, "itl": itl,
            "per_stream": per_stream, "decode_agg": decode_agg, "decode_full": decode_full,
            "prompt_tokens": statistics.mean(ptoks) if ptoks else float("nan"),
            "prefill": statistics.mean(prefill) if prefill else float("nan"),
            "spec_proposed": sum(int(x.get("proposed", 0)) for x in specs),
            "spec_accepted": sum(int(x.get("accepted", 0)) for x in specs)}


def _session(streams: int, timeout_s: float) -> aiohttp.ClientSession:
    """The bench's client: a connection per stream, kept alive between its requests."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=streams + 4, limit_per_host=streams + 4),
        timeout=aiohttp.ClientTimeout(total=timeout_s))


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
                 env: dict[str, str] | None = None) -> None:
        self.log = open(log_path, "wb")
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


def _row(target: str, b: BenchConfig, m: dict[str, Any], rss: float, overrides: str,
         kv_bytes: float = float("nan")) -> Row:
    proposed, accepted = m.get("spec_proposed", 0), m.get("spec_accepted", 0)
    return Row(target, b.workload, b.streams, m["requests"], m["tokens"], round(m["wall"], 2),
               round(m["tokens"] / m["wall"], 2),
               round(statistics.median(m["per_stream"]), 2) if m["per_stream"] else float("nan"),
               round(_pct(m["ttft"], 0.5), 3), round(_pct(m["ttft"], 0.95), 3),
               round(_pct(m["itl"], 0.5), 1), round(_pct(m["itl"], 0.95), 1), round(rss, 1),
               overrides, round(m.get("prompt_tokens", float("nan")), 1),
               round(m.get("prefill", float("nan")), 1),
               round(m.get("decode_agg", float("nan")), 2), proposed, accepted,
               round(accepted / proposed, 3) if proposed else float("nan"), kv_bytes,
               m.get("errors", 0), round(m.get("decode_full", float("nan")), 2))


BARE_LOOP = r"""
import sys, time, json
path, prompt, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if mode == "served":   # the compute pipeserve serves with: its BLAS and compute dtype
    from pipeline.config import ModelConfig, ComputeDType
    from pipeline.loader import _cast_weights
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tok = load(path)
if mode == "served":
    _cast_weights(model, ModelConfig(compute_dtype=ComputeDType(sys.argv[5])))
ids = mx.array(tok.encode(prompt))
for _ in generate_step(ids, model, max_tokens=8):
    pass
stamps = []
for token, _ in generate_step(ids, model, max_tokens=n):
    stamps.append(time.perf_counter())
print(json.dumps({"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""


BATCH_GEN = r"""
import sys, time, json
path, prompts, n, mode = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "served":
    from pipeline.config import ModelConfig, ComputeDType
    from pipeline.loader import _cast_weights
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
model, tok = load(path)
if mode == "served":
    _cast_weights(model, ModelConfig(compute_dtype=ComputeDType(sys.argv[5])))
ids = [tok.encode(p) for p in prompts]
def run(batch, max_tokens):
    # no stop tokens: every row runs to max_tokens, as bench.py's clients do (EOS suppressed)
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=max(len(batch), 1))
    t0 = time.perf_counter()
    uids = gen.insert(batch, [max_tokens] * len(batch))
    first, end, count, stamps = {}, {}, {u: 0 for u in uids}, []
    while len(end) < len(uids):
        out = gen.next_generated()
        if not out:
            break
        now = time.perf_counter()
        for r in out:
            first.setdefault(r.uid, now)
            count[r.uid] += 1
            stamps.append(now)
            if r.finish_reason is not None:
                end[r.uid] = now
    gen.close()
    return t0, first, end, count, stamps
run([i[:16] for i in ids], 8)                      # warm-up: compile the kernels
t0, first, end, count, stamps = run(ids, n)
wall = max(end.values()) - t0
w0, w1 = max(first.values()), min(end.values())
full = sum(1 for t in stamps if w0 < t <= w1) / (w1 - w0) if w1 > w0 else float("nan")
ttft = sorted(v - t0 for v in first.values())
print(json.dumps({"tokens": sum(count.values()), "wall": wall, "full": full,
                  "ttft_p50": ttft[len(ttft) // 2], "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
                  "prompt_tokens": sum(map(len, ids)) / len(ids)}))
"""


STEP_PROBE = r"""
import sys, time, json, statistics
path, compute, ctx, width, streams = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
from pipeline.config import ModelConfig, ComputeDType   # first: interposes the CPU BLAS
from pipeline.kv import attention
from pipeline.loader import _cast_weights
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache
model, _ = load(path)
_cast_weights(model, ModelConfig(compute_dtype=ComputeDType(compute)))
attention.install(model)
vocab = model.args.vocab_size
for rows in sorted({1, streams}):
    for w in sorted({1, width}):
        for composed in (False, True):
            attention.composed = composed
            # rows > 1: left-padded like the engine's batch, so every step carries a mask
            cache = ([KVCache() for _ in model.layers] if rows == 1 else
                     [BatchKVCache(left_padding=[(7 * i) % 37 for i in range(rows)])
                      for _ in model.layers])
            toks = mx.random.randint(0, vocab, (rows, ctx))
            for s in range(0, ctx, 2048):
                model(toks[:, s:s + 2048], cache=cache)
                mx.eval([c.state for c in cache])
            times = []
            for i in range(46):
                t = mx.random.randint(0, vocab, (rows, w))
                mx.eval(t)
                t0 = time.perf_counter()
                mx.eval(model(t, cache=cache))
                times.append(time.perf_counter() - t0)
                if w > 1:
                    for c in cache:
                        c.trim(w - 1)   # the key length grows by one per step, as in decode
            print(json.dumps({"rows": rows, "width": w, "composed": composed,
                              "ms": statistics.median(times[6:]) * 1e3}), flush=True)
            del cache
            mx.clear_cache()
"""


def _step_probe(b: BenchConfig, cfg: ServeConfig, model_dir: Path, out: Path) -> list[Row]:
    """One forward per step shape (one row or `streams` padded rows; one token or
    `step_width`), MLX's fused attention against the composed one, at `step_context` tokens:
    what a decode or verify step costs on this device without the server around it."""
    res = subprocess.run([sys.executable, "-c", STEP_PROBE, str(model_dir),
                          cfg.model.compute_dtype.value, str(b.step_context), str(b.step_width),
                          str(b.streams)], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=b.timeout_s)
    rows = []
    for line in res.stdout.strip().splitlines():
        r = json.loads(line)
        label = (f"step: {r['rows']} row(s) x {r['width']} token(s), "
                 f"{'composed' if r['composed'] else 'fused'} attention")
        rows.append(Row(label, "steps", r["rows"], 1, r["rows"] * r["width"], float("nan"),
                        round(1000 * r["rows"] / r["ms"], 2), float("nan"), float("nan"),
                        float("nan"), round(r["ms"], 2), float("nan"), float("nan"),
                        f"step_context={b.step_context}"))
    _write(out, rows)
    return rows


def run_bench(raw: DictConfig) -> list[Row]:
    cfg = load_config(raw)            # same checks as serve.py, before anything starts
    b = cfg.bench
    from pipeline.loader import resolve_path
    model_dir = resolve_path(cfg.model)
    out = Path(b.out) if Path(b.out).is_absolute() else ROOT / b.out
    out.mkdir(parents=True, exist_ok=True)
    _new_tables(out)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("bench.")]
    eos = _eos_ids(model_dir)
    eos_bias = {str(i): -100.0 for i in eos}
    rows: list[Row] = []

    if b.workload == "steps":
        return _step_probe(b, cfg, model_dir, out)
    if b.workload == "vision":   # image requests, beside mlx-vlm's generate (bench_vision.py)
        import bench_vision
        rows = bench_vision.run(b, cfg.model.name, overrides, model_dir, out, eos)
        _write(out, rows)
        return rows
    if b.workload == "cache_ttft":
        rows = _cache_ttft(b, cfg.model.name, overrides, model_dir, out, eos_bias)
        _write(out, rows)
        return rows
    adapters = _write_adapters(model_dir, out / "adapters", b.adapters) if b.adapters else None
    mount = ([f"model.adapter_dir={out / 'adapters'}", f"model.adapters=[{','.join(adapters)}]"]
             if adapters else [])
    # server.port as given (a firewall rule, a port forward), else a free one
    port = cfg.server.port if any(o.startswith("server.port=") for o in overrides) else _free_port()
    serve = [sys.executable, str(ROOT / "serve.py"), *overrides, *mount, f"model.path={model_dir}",
             f"model.name={cfg.model.name}",   # the id the bench asks for, not the dir's name
             f"server.port={port}", "server.host=127.0.0.1", f"hydra.run.dir={out / 'serve-run'}"]
    launch, env, others = _ranks(cfg, b, serve, out)   # distributed≠none: b.ranks on 127.0.0.1
    ours = Process([*launch, *serve], out / "pipeserve.log", group=bool(launch), env=env)
    try:
        ours.wait_http(f"http://127.0.0.1:{port}/health")
        m = asyncio.run(drive(f"http://127.0.0.1:{port}", cfg.model.name, b, eos_bias, adapters))
        kv = _gauge(f"http://127.0.0.1:{port}", "pipeserve_kv_bytes_per_token")
        rows.append(_row("pipeserve", b, m, _peak_rss_mb(ours.proc.pid), " ".join(overrides), kv))
        _write(out, rows[-1:])
        _plot_run(out, "pipeserve", m, rows[-1])
    finally:
        ours.stop()
        for rank in others:   # they leave with rank 0; stop() waits for that
            rank.stop()

    if b.engine_alone:
        prompt_tokens = rows[-1].prompt_tokens if rows else float("nan")
        rows.append(_engine_alone(b, overrides, model_dir, prompt_tokens))
        _write(out, rows[-1:])

    if b.mlx_lm:
        port = _free_port()
        peer = Process([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                        "--host", "127.0.0.1", "--port", str(port), "--temp", "0",
                        "--max-tokens", str(b.max_tokens)], out / "mlx_lm_server.log")
        try:
            peer.wait_http(f"http://127.0.0.1:{port}/health")
            m = asyncio.run(drive(f"http://127.0.0.1:{port}", str(model_dir), b, eos_bias))
            rows.append(_row("mlx_lm.server", b, m, _peak_rss_mb(peer.proc.pid), ""))
            _write(out, rows[-1:])
            _plot_run(out, "mlx_lm.server", m, rows[-1])
        finally:
            peer.stop()

    if b.batch_generator:
        rows.append(_batch_generator(b, cfg, model_dir))
        _write(out, rows[-1:])

    if b.bare_loop:
        prompt = _prompts(b)[0]
        for mode, label in (("plain", "bare mlx-lm loop"),
                            ("served", "bare mlx-lm loop, pipeserve's compute")):
            res = subprocess.run([sys.executable, "-c", BARE_LOOP, str(model_dir), prompt,
                                  str(b.max_tokens), mode, cfg.model.compute_dtype.value],
                                 capture_output=True, text=True, check=True, cwd=ROOT,
                                 timeout=b.timeout_s)
            tok_s = json.loads(res.stdout.strip().splitlines()[-1])["tok_s"]
            rows.append(Row(label, "single", 1, 1, b.max_tokens, float("nan"), round(tok_s, 2),
                            round(tok_s, 2), float("nan"), float("nan"), round(1000 / tok_s, 1),
                            float("nan"), float("nan")))
            _write(out, rows[-1:])
    return rows


def _engine_alone(b: BenchConfig, overrides: list[str], model_dir: Path,
                  prompt_tokens: float) -> Row:
    """The engine with no HTTP around it (one process, pipeserve's own config): random prompt
    ids as long as the server's prompts were, greedy, logit_bias suppressing EOS."""
    n = round(prompt_tokens) if prompt_tokens == prompt_tokens else b.prompt_words
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_alone.py"),
                          "--streams", str(b.streams), "--max-tokens", str(b.max_tokens),
                          "--prompt-tokens", str(n), "--bias", "on", "--library", "none", "--",
                          *overrides, f"model.path={model_dir}"],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=b.timeout_s)
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    r = next(g for g in got if g.get("what") == "engine alone")
    row = Row("pipeserve engine alone", b.workload, b.streams, b.streams, r["tokens"],
              r["wall_s"], r["agg_tok_s"], r["decode_tok_s_row"] or float("nan"),
              r["ttft_p50_s"], r["ttft_p95_s"], float("nan"), float("nan"), float("nan"))
    row.prompt_tokens = float(n)
    return row


def _batch_generator(b: BenchConfig, cfg: ServeConfig, model_dir: Path) -> Row:
    """The same prompts, all at once, through mlx-lm's BatchGenerator in one process: the
    library's batched rate with no server, HTTP or detokenizing around it, computing in the
    dtype pipeserve serves (model.compute_dtype; on a GPU that is the checkpoint's)."""
    prompts = _prompts(b)
    res = subprocess.run([sys.executable, "-c", BATCH_GEN, str(model_dir), json.dumps(prompts),
                          str(b.max_tokens), "served", cfg.model.compute_dtype.value],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=b.timeout_s)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    row = Row("mlx-lm BatchGenerator", b.workload, b.streams, len(prompts), r["tokens"],
              round(r["wall"], 2), round(r["tokens"] / r["wall"], 2), float("nan"),
              round(r["ttft_p50"], 3), round(r["ttft_p95"], 3), float("nan"), float("nan"),
              float("nan"))
    row.prompt_tokens = round(r["prompt_tokens"], 1)
    row.decode_full_tok_s = round(r["full"], 2)
    return row


def _cache_ttft(b: BenchConfig, model: str, overrides: list[str], model_dir: Path, out: Path,
                eos_bias: dict[str, float]) -> list[Row]:
    """TTFT of one long prompt: cold, then a RAM hit, then (after flush, SIGTERM and a fresh
    start on the same cache.ssd.dir) an SSD hit. Needs cache=ssd among the overrides."""
    if "cache=ssd" not in overrides:
        raise SystemExit("bench.workload=cache_ttft needs cache=ssd (and cache.ssd.dir=...)")
    prompt = _words(b.prompt_words, 0)
    rows = []
    for phase in ("cold", "ram hit", "ssd hit after restart"):
        if phase != "ram hit":
            port = _free_port()
            server = Process([sys.executable, str(ROOT / "serve.py"), *overrides,
                              f"model.path={model_dir}", f"model.name={model}",
                              f"server.port={port}",
                              f"hydra.run.dir={out / 'serve-run'}"], out / "pipeserve.log")
            server.wait_http(f"http://127.0.0.1:{port}/health")
        base = f"http://127.0.0.1:{port}"
        if phase == "cold":   # compile kernels on a prompt that shares nothing
            asyncio.run(_single(base, model, "warm-up " + _words(b.prompt_words, 5), 4, eos_bias))
        r = asyncio.run(_single(base, model, prompt, b.max_tokens, eos_bias))
        ttft = r["stamps"][0] - r["t0"]
        rows.append(Row(f"pipeserve, {phase}", "cache_ttft", 1, 1, r["tokens"],
                        round(r["end"] - r["t0"], 3), float("nan"), float("nan"),
                        round(ttft, 3), round(ttft, 3), float("nan"), float("nan"),
                        round(_peak_rss_mb(server.proc.pid), 1), " ".join(overrides)))
        if phase != "cold":
            _get(base + "/admin/cache/flush", 600, data=b"")
            server.stop()
    return rows


async def _single(base: str, model: str, prompt: str, n: int, bias: dict[str, float]) -> dict:
    async with _session(1, 600) as client:
        return await _one(client, f"{base}/v1/completions", model, prompt, n, bias)


def _eos_ids(model_dir: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = model_dir / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return sorted(ids)


def _plot_run(out: Path, target: str, m: dict[str, Any], ours: Row | None) -> None:
    """Plots next to the table: a single run's per-request latency (latency.png); in a -m
    sweep, each job adds its pipeserve row to sweep.csv and sweep.png is redrawn from it."""
    import bench_plots
    from hydra.types import RunMode
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench: no plots (matplotlib is not installed: pip install -e '.[bench]')", flush=True)
        return
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    if not sweep:
        if target == "pipeserve":
            (out / "requests.csv").unlink(missing_ok=True)
        bench_plots.write_requests(out, target, m["per_request"])
        drawn = bench_plots.plot_latency(out)
        if drawn is not None:
            print(f"bench: plot {drawn}", flush=True)
    elif ours is not None:   # all of the job's overrides, bench.* too: any may be swept
        ours = replace(ours, overrides=" ".join(hc.overrides.task))
        if hc.job.num == 0 and target == "pipeserve":   # the first row of this sweep
            (out / "sweep.csv").unlink(missing_ok=True)
        table = out / "sweep.csv"
        new = not table.exists()
        with open(table, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(asdict(ours).keys()))
            if new:
                w.writeheader()
            w.writerow(asdict(ours))
        drawn = bench_plots.plot_sweep(out)   # None until the sweep has two rows
        if drawn is not None:
            print(f"bench: plot {drawn}", flush=True)


def _write_adapters(model_dir: Path, root: Path, n: int) -> list[str]:
    """n LoRA adapters for the bench model in mlx_lm.lora's format (rank 8 on every layer's
    q_proj and v_proj, random non-zero A and B), written once per run under `root`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model
    model, config = load_model(model_dir)
    layers = int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])
    params = {"rank": 8, "scale": 2.0, "dropout": 0.0,
              "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    linear_to_lora_layers(model, layers, params)
    lora = [(k, p) for k, p in tree_flatten(model.parameters()) if k.endswith(("lora_a", "lora_b"))]
    ids = []
    for a in range(n):
        out = root / f"a{a}"
        ids.append(out.name)
        if (out / "adapters.safetensors").exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        key = mx.random.key(a)
        weights = {k: 0.05 * mx.random.normal(p.shape, key=mx.random.split(key, i + 1)[i])
                   for i, (k, p) in enumerate(lora)}
        mx.save_safetensors(str(out / "adapters.safetensors"), weights)
        (out / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": params}))
    return ids


SUMMARY = ["target", "workload", "streams", "requests", "output_tokens", "agg_tok_s",
           "stream_tok_s_p50", "ttft_p50_s", "ttft_p95_s", "itl_p50_ms", "errors"]


def _new_tables(out: Path) -> None:
    """A run starts its own results.csv / results.md; the jobs of one -m sweep share them
    (the first job starts them)."""
    from hydra.types import RunMode
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or hc.job.num == 0:
        for name in ("results.csv", "results.md"):
            (out / name).unlink(missing_ok=True)


def _write(out: Path, rows: list[Row]) -> None:
    for r in rows:
        print(f"bench: {r.target} done: {r.agg_tok_s} tok/s aggregate", flush=True)
    csv_path = out / "results.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    with open(csv_path) as f:
        all_rows = list(csv.DictReader(f))
    cols = list(all_rows[0].keys())
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r[c] for c in cols) + " |" for r in all_rows]
    (out / "results.md").write_text("\n".join(md) + "\n")
    # the terminal gets the headline columns; results.csv / results.md have every column
    short = ["| " + " | ".join(SUMMARY) + " |", "|" + "---|" * len(SUMMARY)]
    short += ["| " + " | ".join(r.get(c, "") for c in SUMMARY) + " |" for r in all_rows]
    print("\n".join(short) + f"\n(all {len(cols)} columns: {out / 'results.md'})")


@dataclass
class BenchRootConfig(ServeConfig):
    bench: BenchConfig = field(default_factory=BenchConfig)


register_configs()
ConfigStore.instance().store(name="bench_schema", node=BenchRootConfig)


@hydra.main(config_path="conf", config_name="bench", version_base="1.3")
def main(raw: DictConfig) -> None:
    run_bench(raw)


if __name__ == "__main__":
    main()
