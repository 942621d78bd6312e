"""bench.workload=ttft: the time to the first token where users feel it, through HTTP, beside
mlx-lm's own prefill of the same prompts in the same run. Prompts are token ids (exact lengths;
random tokens after a shared head of bench.ttft_prefix tokens, as a chat template or a system
prompt gives every request):

- first burst: bench.ttft_first_burst arrivals right after the server is ready (kernels not
  yet compiled for their shapes), then the same burst again;
- untimed: each burst size twice (the second over the connections the first opened, so each
  burst's batch shape is met in one step, as the library's BatchGenerator meets it);
- cold prompts one after another (bench.ttft_cold lengths), each sharing only the head with
  what the prompt cache holds;
- after them, the last of the longest cold prompts again (an exact repeat: a prompt-cache hit)
  and with 64 new tokens (a new turn on the cached prefix);
- bursts of bench.ttft_bursts simultaneous 76-token prompts, without and with a logit_bias on
  every request (the same prompts again: below cache.min_reuse_tokens they are computed), each
  sent when the one before has finished, its row's wall_s the burst's first request sent to
  its last finished;
- with bench.ttft_shared_head, bursts whose prompts share a head that long (one request with
  it first, so the cache holds it) before 76 tokens of their own;
- the library: mlx-lm's generate_step time to its first token for each cold prompt, and its
  BatchGenerator's for each burst, in a child process after the server stopped."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeserve.bench.config import CORES, BenchConfig, Row
from pipeserve.bench.server import (ROOT, Process, _free_port, _peak_rss_mb, _state,
                                    _with_children)
from pipeserve.bench.workload import _one, _pct, _session

BURST_TOKENS = 76   # prompt length of a burst's requests
OUT_TOKENS = 4      # tokens each request generates: enough to see the first
TURN_TOKENS = 64    # a new turn's tokens after a cached prefix

LIBRARY = r"""
import sys, time, json
import pipeserve   # the CPU BLAS pipeserve computes with, before mlx loads
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
path, spec = sys.argv[1], json.load(open(sys.argv[2]))
model, _ = load(path)
def first_token(ids, chunk):
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=chunk):
        mx.eval(tok)
        break
    return time.perf_counter() - t0
first_token(spec["warm"], spec["chunk"])   # the chunk shapes, once, as the server had
print(json.dumps({"cold": [first_token(ids, spec["chunk"]) for ids in spec["cold"]]}), flush=True)
for key, prompts in [*spec["bursts"].items(), *(("s" + k, p) for k, p in spec["shared"].items())]:
    # prefill at most the server's step budget of prompt tokens at once (a burst of long
    # prompts prefilled whole would need the attention scores of all of them together)
    budget = spec["budget"] or (16384 if mx.default_device() == mx.gpu else 2048)   # as Limits.fit
    per = max(1, min(len(prompts), budget // max(1, len(prompts[0]))))
    for rep in range(2):   # the first compiles this batch's shapes
        gen = BatchGenerator(model, max_tokens=2, completion_batch_size=len(prompts),
                             prefill_batch_size=per)
        t0 = time.perf_counter()
        uids = gen.insert(prompts, [2] * len(prompts))
        first = {}
        while len(first) < len(uids):
            for r in gen.next_generated() or []:
                first.setdefault(r.uid, time.perf_counter() - t0)
        gen.close()
    print(json.dumps({"burst": key, "ttft": sorted(first.values())}), flush=True)
"""


def _ids(rng: random.Random, n: int, vocab: int, head: list[int]) -> list[int]:
    return head + [rng.randrange(3, vocab) for _ in range(n - len(head))]


def _row(target: str, what: str, streams: int, ttft: list[float], out_tokens: int,
         overrides: str, rss: float = float("nan"), prompt_tokens: int = 0) -> Row:
    row = Row(target, f"ttft:{what}", streams, len(ttft), out_tokens * len(ttft), float("nan"),
              float("nan"), float("nan"), round(_pct(ttft, 0.5), 4), round(_pct(ttft, 0.95), 4),
              float("nan"), float("nan"), rss, overrides)
    row.prompt_tokens = prompt_tokens
    if prompt_tokens and ttft:   # all the rows' prompt tokens over the median first token
        row.prefill_tok_s = round(prompt_tokens * streams / statistics.median(ttft), 1)
    return row


async def _burst(client: Any, base: str, model: str, prompts: list[list[int]],
                 bias: dict[str, float], spent: list[float] | None = None,
                 made: list[int] | None = None,
                 sends: list[dict[str, float]] | None = None) -> list[float]:
    """Each request's time to its first token, sorted; `spent` gets the burst's wall time,
    its first request sent to its last finish (what a client that sends again when all are
    done waits for each round); `made`, the tokens its responses say they generated; `sends`,
    the ms after the first request's start when the client had written its requests (p50,
    last), against which the server's arrival spread (request_log_bursts.py) reads, and how
    many requests the client sent again after a refused or reset connection."""
    got = await asyncio.gather(*(_one(client, f"{base}/v1/completions", model, p,
                                      OUT_TOKENS, bias) for p in prompts))
    if spent is not None and got:
        spent.append(max(r["end"] for r in got) - min(r["t0"] for r in got))
    if sends is not None and got:
        start = min(r["t0"] for r in got)
        at = sorted(1000 * (r["sent"] - start) for r in got if r.get("sent") is not None)
        sends.append({"client_sent_ms_p50": round(_pct(at, 0.5), 2) if at else float("nan"),
                      "client_sent_ms_last": round(at[-1], 2) if at else float("nan"),
                      "client_retries": sum(r.get("retries", 0) for r in got),
                      "ids": [r["id"] for r in got if r.get("id")]})
    if made is not None:
        made.append(sum(int(r["tokens"] or 0) for r in got))
    return sorted(r["stamps"][0] - r["t0"] for r in got if r["stamps"])


def run(b: BenchConfig, model: str, vocab: int, chunk: int, overrides: list[str],
        model_dir: Path, out: Path, eos_bias: dict[str, float],
        write: Callable[[list[Row]], None], budget: int | None = None) -> list[Row]:
    """The rows of each scenario, one server per bench.cores placement given the same prompts;
    `chunk` is the server's prompt chunk (scheduler.prefill_chunk), the library's prefill step
    here, and `budget` its prompt tokens a step (scheduler.max_num_batched_tokens; None: the
    device's default), the most the library's BatchGenerator prefills at once. Each server's
    rows, then the library's, are handed to `write` as they are measured, so a run cut short
    (a device call's time limit) keeps what it measured."""
    rng = random.Random(17)
    vocab = min(vocab, 500)
    head = [rng.randrange(3, vocab) for _ in range(b.ttft_prefix)]
    cold = [_ids(rng, int(n), vocab, head) for n in b.ttft_cold]
    sizes = [int(n) for n in b.ttft_bursts]
    bursts = {n: [_ids(rng, BURST_TOKENS, vocab, []) for _ in range(n)] for n in sizes}
    warm = _ids(rng, max((len(c) for c in cold), default=BURST_TOKENS), vocab, [])
    first = [_ids(rng, BURST_TOKENS, vocab, []) for _ in range(b.ttft_first_burst)]
    shapes = {n: [_ids(rng, BURST_TOKENS, vocab, []) for _ in range(n)] for n in sizes}
    system = [rng.randrange(3, vocab) for _ in range(b.ttft_shared_head)]
    shared = {n: [system + _ids(rng, BURST_TOKENS, vocab, []) for _ in range(n + 1)]
              for n in sizes} if system else {}   # one more: the request that stores the head
    turn = [rng.randrange(3, vocab) for _ in range(TURN_TOKENS)]
    # the shapes' second pass, on prompts of its own (a repeat could meet the prompt cache):
    # drawn last, so every other scenario's prompts are what they were before it
    shapes_again = {n: [_ids(rng, BURST_TOKENS, vocab, []) for _ in range(n)] for n in sizes}
    rows: list[Row] = []
    for core in b.cores:
        target = "pipeserve" if core == "thread" else f"pipeserve, core {core}"
        done = _serve(target, [*overrides, *CORES[core]], model, model_dir,
                      out / ("" if core == "thread" else f"core-{core}"),
                      first, warm, [shapes, shapes_again], cold, bursts, eos_bias, shared,
                      turn)
        if done:
            write(done)
        rows += done
    if not (b.batch_generator or b.bare_loop):
        return rows
    spec = out / "ttft-prompts.json"
    spec.write_text(json.dumps({"warm": warm, "cold": cold, "chunk": chunk, "budget": budget,
                                "bursts": {str(n): p for n, p in bursts.items()},
                                "shared": {str(n): p[1:] for n, p in shared.items()}}))
    res = subprocess.run([sys.executable, "-c", LIBRARY, str(model_dir), str(spec)],
                         capture_output=True, text=True, cwd=ROOT, timeout=b.timeout_s)
    lib: dict[str, Any] = {"cold": [], "bursts": {}}
    for line in res.stdout.splitlines():   # one line per scenario, as measured
        if line.startswith("{"):
            got = json.loads(line)
            if "cold" in got:
                lib["cold"] = got["cold"]
            elif "burst" in got:
                lib["bursts"][got["burst"]] = got["ttft"]
    if res.returncode:   # a scenario the library could not run (its memory): keep the others
        (out / "library.log").write_text(res.stdout[-20000:] + res.stderr[-20000:])
        print(f"bench: the library's run ended early (exit {res.returncode}) after "
              f"{len(lib['bursts'])} burst(s); its output: {out / 'library.log'}",
              file=sys.stderr)
    mark = len(rows)
    for i, (ids, s) in enumerate(zip(cold, lib["cold"])):
        rows.append(_row("mlx-lm generate_step", f"cold prompt {i + 1}", 1, [s], 1, "",
                         prompt_tokens=len(ids)))
    for n, ttft in lib["bursts"].items():
        if n.startswith("s"):   # the shared-head burst's prompts, prefilled whole
            size = len(shared[int(n[1:])][0])
            rows.append(_row("mlx-lm BatchGenerator",
                             f"burst, shared {size - BURST_TOKENS}-token head", int(n[1:]), ttft,
                             2, "", prompt_tokens=size))
            continue
        rows.append(_row("mlx-lm BatchGenerator", "burst", int(n), ttft, 2, "",
                         prompt_tokens=BURST_TOKENS))
    if rows[mark:]:
        write(rows[mark:])
    return rows


@contextmanager
def _stacks_if_slow(pid: int, log: Path, after_s: float = 2.0, every_s: float = 3.0,
                    most: int = 4) -> Iterator[None]:
    """A scenario still running after `after_s`: the server and its engine core's process
    (server.isolate=true; its pid from the log) write their threads' stacks to the server's
    log (kill -USR1, pipeserve/launch/stacks.py), every `every_s`, at most `most` times: where
    a slow burst's seconds go, from a device call that keeps only files."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(after_s):
            return
        for _ in range(most):
            cores = re.findall(r"engine process (\d+) started", log.read_text(errors="replace"))
            for p in [pid, *map(int, cores[-1:])]:
                try:
                    os.kill(p, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            if done.wait(every_s):
                return
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _serve(target: str, overrides: list[str], model: str, model_dir: Path, out: Path,
           first: list[list[int]], warm: list[int], shapes: list[dict[int, list[list[int]]]],
           cold: list[list[int]], bursts: dict[int, list[list[int]]],
           eos_bias: dict[str, float], shared: dict[int, list[list[int]]],
           turn: list[int]) -> list[Row]:
    """One server launched with `overrides`, each scenario sent to it in turn: its rows. One
    client session serves them all, a connection per stream kept alive from one scenario to
    the next (as an SDK's connection pool does), so a burst's first tokens are the server's
    and not the TCP connects of 128 new connections (only the first burst after launch makes
    them)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    server = Process([sys.executable, str(ROOT / "serve.py"), *overrides,
                      f"model.path={model_dir}", f"model.name={model}", f"server.port={port}",
                      f"hydra.run.dir={out / 'serve-run'}"], out / "pipeserve.log")
    base, said = f"http://127.0.0.1:{port}", " ".join(overrides)
    rows: list[Row] = []
    memory = (out / "memory.jsonl").open("w")

    spent: list[float] = []   # each timed scenario's wall: the bursts' rows show it
    made: list[int] = []      # each timed scenario's generated tokens, as its responses said
    sends: list[dict[str, float]] = []   # each timed scenario's client send spread

    runner = asyncio.Runner()
    streams = max([len(first), 1, *map(len, shapes[0].values()), *map(len, bursts.values()),
                   *map(len, shared.values())])
    client = runner.run(_open(streams))

    def send(prompts: list[list[int]], bias: dict[str, float], **kw: Any) -> list[float]:
        return runner.run(_burst(client, base, model, prompts, bias, **kw))

    def timed(prompts: list[list[int]], bias: dict[str, float]) -> list[float]:
        with _stacks_if_slow(server.proc.pid, out / "pipeserve.log"), _client_gc() as paused:
            got = send(prompts, bias, spent=spent, made=made, sends=sends)
        sends[-1]["client_gc_ms"] = round(paused[0] * 1000, 2)
        return got

    def note(scenario: str) -> None:   # the server's memory and stage seconds so far
        sent = dict(sends[-1])
        server_ttft = _server_ttft(out / "pipeserve.log", sent.pop("ids", []))
        memory.write(json.dumps({"scenario": scenario, **_state(base),
                                 "bench_mlx_gb": _own_mlx_gb(), **sent,
                                 "server_ttft_p50_s": _pct(server_ttft, 0.5),
                                 "server_ttft_found": len(server_ttft)}) + "\n")
        memory.flush()
    try:
        t0 = time.perf_counter()
        server.wait_http(f"{base}/health")
        ready_s = time.perf_counter() - t0
        if first:
            for label in ("first burst after launch", "the same burst again"):
                ttft = timed(first, {})
                rows.append(_row(target, label, len(first), ttft, OUT_TOKENS, said,
                                 prompt_tokens=BURST_TOKENS))
                rows[-1].wall_s = round(ready_s, 1)   # launch to ready
                note(label)
        send([warm], {})   # the chunk shapes, as the library gets
        # and each burst's batch shapes, twice: the client opens the connections a burst needs
        # only after writing on those it has, and the server took the first pass's late ones
        # in steps of their own (round 14); the second arrives together, as the timed ones do
        for each_pass in shapes:
            for prompts in each_pass.values():
                send(prompts, {})
        for i, ids in enumerate(cold):
            ttft = timed([ids], {})
            rows.append(_row(target, f"cold prompt {i + 1}", 1, ttft, OUT_TOKENS, said,
                             prompt_tokens=len(ids)))
            note(rows[-1].workload)
        if cold:   # the last of the longest: still in the cache after the ones before it
            ref = max(reversed(cold), key=len)
            for label, ids in (("exact repeat", ref), ("new turn on a cached prefix", ref + turn)):
                ttft = timed([ids], {})
                rows.append(_row(target, label, 1, ttft, OUT_TOKENS, said,
                                 prompt_tokens=len(ids)))
                note(label)
        for n, prompts in bursts.items():
            for bias in ({}, eos_bias):
                ttft = timed(prompts, bias)
                label = f"burst{' + logit_bias' if bias else ''}"
                rows.append(_row(target, label, n, ttft, OUT_TOKENS, said,
                                 prompt_tokens=BURST_TOKENS))
                rows[-1].wall_s = round(spent[-1], 4)   # first sent to last finished
                note(f"{label} {n}")
        for n, prompts in shared.items():
            send(prompts[:1], {})   # the head, into the cache
            ttft = timed(prompts[1:], {})
            rows.append(_row(target, f"burst, shared {len(prompts[0]) - BURST_TOKENS}-token head",
                             n, ttft, OUT_TOKENS, said, prompt_tokens=len(prompts[0])))
            note(f"{rows[-1].workload} {n}")
        rss = sum(_peak_rss_mb(pid) for pid in _with_children(server.proc.pid))
        for r, tokens in zip(rows, made, strict=True):   # one timed call a row, in order
            r.peak_rss_mb = round(rss, 1)
            r.output_tokens = tokens   # what the responses reported, not what was asked for
    finally:
        try:   # after a failed request (SystemExit in a burst's task) this re-raises it
            runner.run(client.close())
            runner.close()
        finally:   # so the server is stopped whatever the client's loop does
            memory.close()
            server.stop()
    return rows


@contextmanager
def _client_gc() -> Iterator[list[float]]:
    """A timed scenario's client with its collector's work done before it: a full collection,
    then everything frozen (as the server does once ready), so a collection inside the burst
    walks only what the burst made. Yields [seconds the collector paused the client during the
    scenario]: a client paused mid-burst delays its last requests and reads every stream's
    first token late."""
    paused, began = [0.0], [0.0]

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            paused[0] += time.perf_counter() - began[0]
    gc.collect()
    gc.freeze()
    gc.callbacks.append(seen)
    try:
        yield paused
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()


REQUEST_LINE = re.compile(r" - request (\S+) .*?\bttft_s=([\d.]+)")


def _server_ttft(log: Path, ids: list[str], wait_s: float = 2.0) -> list[float]:
    """The server's own time to the first token of each of `ids` (its request log: handler
    start to first token), sorted: beside the client's, it tells the server's share from the
    client's. The lines are written as requests finish, through the log's own thread: read
    again for up to `wait_s` until every id has one."""
    want, found = set(ids), {}
    deadline = time.monotonic() + wait_s
    while want:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = {m.group(1): float(m.group(2)) for m in REQUEST_LINE.finditer(text)
                 if m.group(1) in want}
        if len(found) == len(want) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return sorted(found.values())


def _own_mlx_gb() -> float:
    """What MLX holds in this (the bench's) process, active and cached (GB): memory the
    servers measured beside it do not have (round 10: an 8B the bench had generated, ~42 GB
    on the device; pipeserve/model/cache.py now gives it back)."""
    mx = sys.modules.get("mlx.core")
    return round((mx.get_active_memory() + mx.get_cache_memory()) / 1e9, 3) if mx else 0.0


async def _open(streams: int) -> Any:
    """The bench's client session, made on the loop that will use it."""
    return _session(streams, 600)
