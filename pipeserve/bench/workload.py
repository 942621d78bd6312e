"""The client workloads: prompts, one streaming request, N concurrent streams (aiohttp, one
connection per stream), and what each request measured."""
from __future__ import annotations

import asyncio
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import aiohttp
except ImportError:   # the base install has no bench client
    sys.exit("bench.py needs the bench extra (aiohttp, its client; matplotlib, its plots): "
             "pip install -e '.[bench]'")
import orjson

from pipeserve.bench import host
from pipeserve.bench.config import BenchConfig
from pipeserve.model.tiny.text import CORPUS

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jumbled figures near the old river bank and count every small stone").split()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# steps through WORDS that visit every word (coprime with its 26): 12 orders of it
STRIDES = [k for k in range(1, len(WORDS)) if math.gcd(k, len(WORDS)) == 1]


def _words(n: int, offset: int) -> str:
    """n words of WORDS from `offset`, in order for offsets below 26; each next 26 offsets step
    through it by another stride. So up to 312 prompts are distinct and no two share more than
    their first word: a burst's later requests cannot hit the prompt cache on an earlier one's
    prompt (with one order, request 26 repeated request 0 and 128 streams had 26 prompts)."""
    stride = STRIDES[(offset // len(WORDS)) % len(STRIDES)]
    return " ".join(WORDS[(offset + j * stride) % len(WORDS)] for j in range(n))


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
            got = await _one_try(client, url, model, prompt, max_tokens, eos_bias)
            got["retries"] = attempt   # each one cost a reconnect after a 0.2 s+ sleep
            return got
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
    rid = None   # the response's id: its line in the server's request log
    end = float("nan")
    sent: dict[str, float] = {}   # when its headers were written (the session's trace hook)
    async with client.post(url, data=orjson.dumps(body), trace_request_ctx=sent,
                           headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:   # the server's own error names the field and the limit
            raise SystemExit(f"bench: {url} answered {r.status}: {(await r.text())[:500]}")
        async for line in r.content:   # SSE, one line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            now = time.perf_counter()
            rid = rid or chunk.get("id")
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
    return {"t0": t0, "stamps": stamps, "tokens": n, "end": end, "sent": sent.get("at"),
            "id": rid, "prompt_tokens": usage.get("prompt_tokens"),
            "speculation": usage.get("speculation")}


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
                adapters: list[str] | None = None,
                cpu: Callable[[], dict[str, float]] | None = None) -> dict[str, Any]:
    """The timed load against one server: its figures. `cpu` (the server's CPU seconds by
    role, bench/server.py's thread_cpu) is read at the start and end of the timed part: each
    role's share of that wall, beside this client's own loop's ("client loop"), says whether
    one event loop was saturated (`m["cpu"]`)."""
    prompts = _prompts(b)
    base_model = model

    def model_of(i: int) -> str:   # request i's model id: the base, or "<base>:<adapter>"
        return f"{base_model}:{adapters[i % len(adapters)]}" if adapters else base_model

    url = f"{base_url}/v1/completions"
    # aiohttp, one kept-alive connection per stream. The client must not be what is measured:
    # httpx's pool rescans every connection for every queued request, so at many streams the
    # client itself was the bottleneck (docs/notes, the bench client: httpx against aiohttp)
    async with _session(b.streams, b.timeout_s) as client:
        warmed: list[dict[str, Any]] = []
        if b.warmup:   # compile kernels for these shapes (GPU JIT) before timing
            warm = _prompts(b, salt="warm-up")
            warmed.append(await _one(client, url, model_of(0), warm[0], b.max_tokens, eos_bias))
            warmed += await asyncio.gather(*(_one(client, url, model_of(i), p, 16, eos_bias)
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
        probe = host.probe_ms()   # before the load: the client's loop is idle
        cpu0, mine0, steal0 = (cpu() if cpu else {}), time.thread_time(), host.steal_s()
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(k) for k in range(b.streams)))
                   for r in rs]
        wall = time.perf_counter() - t0
        cpu1, mine1, steal1 = (cpu() if cpu else {}), time.thread_time(), host.steal_s()
    shares = {k: (cpu1[k] - cpu0.get(k, 0.0)) / wall for k in cpu1}
    shares["client loop"] = (mine1 - mine0) / wall
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
    # the token lengths of the prompts sent, warm-up and timed (the engine-alone row's prompts)
    lengths = {"warm": [r["prompt_tokens"] for r in warmed],
               "timed": [r["prompt_tokens"] for r in results]}
    # how far apart this client got the timed requests' headers out (the server's request log
    # says how far apart they arrived: scripts/request_log_bursts.py's arrival_spread_s)
    sent = [r["sent"] for r in results if r.get("sent") is not None]
    send_spread = max(sent) - min(sent) if sent else 0.0
    return {"cpu": shares, "send_spread_s": send_spread, "lengths": lengths,
            "host_steal": (steal1 - steal0) / wall, "host_probe_ms": probe,
            "per_request": per_request, "requests": len(results), "errors": len(failed),
            "tokens": tokens, "wall": wall, "ttft": ttft, "itl": itl,
            "per_stream": per_stream, "decode_agg": decode_agg, "decode_full": decode_full,
            "prompt_tokens": statistics.mean(ptoks) if ptoks else float("nan"),
            "prefill": statistics.mean(prefill) if prefill else float("nan"),
            "spec_proposed": sum(int(x.get("proposed", 0)) for x in specs),
            "spec_accepted": sum(int(x.get("accepted", 0)) for x in specs)}


async def _headers_sent(_: Any, ctx: Any, __: Any) -> None:
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["at"] = time.perf_counter()


def _session(streams: int, timeout_s: float) -> aiohttp.ClientSession:
    """The bench's client: a connection per stream, kept alive between its requests; each
    request's result says when its headers went out (`sent`), to tell the client's sending
    from the server's reading in a burst's arrival spread."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=streams + 4, limit_per_host=streams + 4),
        timeout=aiohttp.ClientTimeout(total=timeout_s), trace_configs=[trace])


async def _single(base: str, model: str, prompt: str, n: int, bias: dict[str, float]) -> dict:
    async with _session(1, 600) as client:
        return await _one(client, f"{base}/v1/completions", model, prompt, n, bias)
