"""Where the time to the first token goes, the engine alone (no HTTP): cold long prompts one
after another, then a short one; a burst of short prompts with and without logit_bias. Each
request's wall time is split into the engine loop's parts (schedule, cache lookup, launch,
read-back, apply, persist, the prompt cache's put and eviction), next to mlx-lm's own prefill
of the same prompts in the same process. One JSON object per line.

    python scripts/ttft_probe.py --cold 16384,16384,16384,4096 -- model=tiny model.size=medium \
        model.dtype=bfloat16 model.compute_dtype=checkpoint
    python scripts/ttft_probe.py --cold none --burst 32,128 -- model=tiny
    python scripts/ttft_probe.py --cold 16384,16384,4096 --repeat --library none -- model=tiny \
        model.max_context=20000

--repeat: after the cold prompts, as bench.py's ttft workload sends them (right after the one
before, no pause): the last of the longest again (an exact repeat) and with 64 new tokens (a
new turn on the cached prefix), each split into the loop's parts: the engine's share of the
bench's "exact repeat" and "new turn" rows, in the same order and cache state.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from engine_alone import StepClock, compose_cfg, instrument, library, run_batch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402


def instrument_more(engine: Any, clock: StepClock) -> None:
    """Timers around the parts a cold prompt may wait for besides the forward."""
    step = engine.step
    clock.wrap(step.persist, "prompts", "persist.prompts")
    clock.wrap(step, "retire", "retire (persist finished)")
    clock.wrap(step, "release", "release")
    clock.wrap(step, "idle", "idle")
    if engine.scheduler.lookup is not None:
        clock.wrap(engine.scheduler, "lookup", "cache_lookup")
    cache = step._cache
    if cache is not None:
        for name in ("put", "_evict", "tick"):
            if hasattr(cache, name):
                clock.wrap(cache, name, f"cache.{name}")


class MxView:
    """mlx.core as one module sees it: timers set on it (StepClock.wrap) leave mlx.core alone."""

    def __init__(self, mx: Any) -> None:
        self._mx = mx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)


def instrument_split(engine: Any, clock: StepClock) -> None:
    """Finer timers inside the parts that store what rows computed (--split): the row copies,
    the batch filter, the cache's own copies, trie, evictions (the frees of what they drop) and
    its one device call, and the every-256th-pass clear_cache."""
    import mlx.core as mx
    from pipeserve.core import rows, step as step_mod
    from pipeserve.prompt_cache import ram
    kv = engine.step.kv
    for name in ("copy_of", "release_many", "entry_bytes"):
        if hasattr(kv, name):
            clock.wrap(kv, name, f"kv.{name}")
    clock.wrap(rows, "extract_rows", "rows.extract_rows")
    clock.wrap(rows, "host_padding", "rows.host_padding")
    clock.wrap(ram, "own", "cache.own")
    for module, label in ((ram, "cache.mx"), (step_mod, "step.mx")):
        module.mx = MxView(mx)
        for name in ("async_eval", "clear_cache"):
            clock.wrap(module.mx, name, f"{label}.{name}")
    cache = engine.step._cache
    if cache is not None:
        for name in ("evict_oldest", "_report", "kept"):
            if hasattr(cache, name):
                clock.wrap(cache, name, f"cache.{name}")
        trie = getattr(cache, "trie", None)
        if trie is not None:
            for name in ("add", "add_over_prefixes", "pop"):
                clock.wrap(trie, name, f"cache.trie.{name}")


def time_gc(clock: StepClock) -> None:
    """The collector's pauses (any thread: each holds the GIL), by generation, in the clock."""
    began = [0.0]

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif clock.on:
            clock.total[f"gc (gen {info['generation']})"] += time.perf_counter() - began[0]
    gc.callbacks.append(seen)


TIMELINE = "part, start ms, ms, rows, prompt rows, prompt tokens"


class Timeline:
    """Each engine-thread call of the wrapped parts, (part, start ms, ms, rows, prompt rows,
    prompt tokens), from `reset()`: where a burst's first step goes, in order."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.on = False
        self.events: list[tuple[str, float, float, int, int, int]] = []

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if self.on:
                    plan = getattr(a[0], "plan", a[0]) if a else None
                    rows = getattr(plan, "rows", ())
                    pre = [r for r in rows if not r.samples]
                    self.events.append((label, round(1000 * (t - self.t0), 1),
                                        round(1000 * (time.perf_counter() - t), 1), len(rows),
                                        len(pre), sum(r.num_tokens for r in pre)))
        setattr(obj, name, timed)

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.events = []


async def one(engine: Any, ids: list[int], max_tokens: int) -> dict[str, float]:
    from pipeserve.core.events import Failed, Finished, TokenDelta
    from pipeserve.core.stream import RequestStream
    from pipeserve.request import PromptInput, Request, SamplingParams
    loop = asyncio.get_running_loop()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req = Request(request_id=f"c-{uuid.uuid4().hex[:8]}", endpoint="bench",
                  inputs=PromptInput(token_ids=ids), prompt_ids=list(ids), sampling=sp,
                  stop_token_ids=frozenset())
    stream = RequestStream(loop)
    t0 = time.perf_counter()
    engine.submit(req, stream)
    first = 0.0
    while True:
        event = await stream.next()
        if isinstance(event, TokenDelta):
            first = first or time.perf_counter()
        elif isinstance(event, Finished):
            return {"ttft_s": round(first - t0, 4), "total_s": round(time.perf_counter() - t0, 4),
                    "cached": req.num_cached_tokens}
        else:
            assert isinstance(event, Failed)
            raise event.error


def memory() -> dict[str, float]:
    import mlx.core as mx
    return {"active_gb": round(mx.get_active_memory() / 1e9, 2),
            "cache_gb": round(mx.get_cache_memory() / 1e9, 2),
            "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}


def library_cold(model_dir: Path, prompts: list[list[int]], warm: list[int],
                 chunk: int) -> list[dict[str, Any]]:
    """mlx-lm's generate_step: the time to its first token for each prompt, one after another
    (one warm-up prompt first, as the engine had)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from pipeserve.model.config import ComputeDType, ModelConfig
    from pipeserve.model.loader import _cast_weights
    model, _ = load(str(model_dir))
    _cast_weights(model, ModelConfig(compute_dtype=ComputeDType("checkpoint")))
    out = []
    for i, ids in enumerate([warm] + prompts):
        t0 = time.perf_counter()
        for _tok, _ in generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=chunk):
            mx.eval(_tok)
            break
        if i:
            out.append({"what": "library cold prompt", "i": i - 1, "tokens": len(ids),
                        "ttft_s": round(time.perf_counter() - t0, 4)})
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", default="16384,16384,16384,4096",
                    help="prompt lengths sent one after another (none: skip)")
    ap.add_argument("--burst", default="none", help="burst sizes of 76-token prompts")
    ap.add_argument("--timeline", action="store_true",
                    help="each burst's engine calls in order (launch, read, apply, persist)")
    ap.add_argument("--library", choices=["all", "none"], default="all")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine thread (cold)")
    ap.add_argument("--split", action="store_true",
                    help="finer timers inside persist and the prompt cache (copies, batch "
                         "filter, trie, evictions' frees, their device calls, clear_cache)")
    ap.add_argument("--prefix", type=int, default=0,
                    help="tokens every cold prompt starts with (a chat template's, say)")
    ap.add_argument("--repeat", action="store_true",
                    help="then the longest cold prompt again, and with 64 new tokens")
    ap.add_argument("--shared-head", type=int, default=0,
                    help="then each burst again, its prompts after one shared head this long "
                         "(one request with it first, so the prompt cache holds it)")
    ap.add_argument("--mlx-trie", action="store_true",
                    help="the prompt cache on mlx-lm's PromptTrie (the before of an A/B)")
    ap.add_argument("--reps", type=int, default=2, help="timed bursts of each kind")
    ap.add_argument("--clear-after-cold", action="store_true",
                    help="MLX's buffer cache emptied after the cold prompts (mx.clear_cache)")
    ap.add_argument("--shapes", default="",
                    help="then bursts of ROWSxTOKENS prompts, in order (e.g. 128x76,128x76,"
                         "128x70): a shape's first burst against its next, the steps' launches")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_cfg(args.overrides)   # first: it sets MLX's environment
    import mlx.core as mx
    if args.mlx_trie:
        from mlx_lm.models.cache import PromptTrie
        from pipeserve.prompt_cache import ram
        ram.TokenTrie = PromptTrie
    from pipeserve.core.engine import Engine
    from pipeserve.metrics import Metrics
    sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)
    engine = Engine(cfg, Metrics(CollectorRegistry()))
    t0 = time.perf_counter()
    engine.start()
    assert engine.wait_ready(1800), f"engine failed: {engine.startup_error!r}"
    gc.collect()
    gc.freeze()   # as the server does once ready: a full collection walks only what came later
    clock = StepClock()
    instrument(engine, clock)
    instrument_more(engine, clock)
    if args.split:
        instrument_split(engine, clock)
    time_gc(clock)
    line = Timeline()
    if args.timeline:   # outermost: the timers above count inside these
        line.wrap(engine.step, "launch", "launch")
        line.wrap(engine.step, "read", "read")
        line.wrap(engine.step.persist, "prompts", "persist.prompts")
        line.wrap(engine.step, "retire", "retire")
        line.wrap(engine, "_apply", "apply")
    print(json.dumps({"what": "loaded", "s": round(time.perf_counter() - t0, 1),
                      "device": str(mx.default_device()), "overrides": args.overrides}),
          flush=True)
    vocab = min(engine.loaded.tokenizer.vocab_size, 500)
    eos = sorted(engine.loaded.tokenizer.eos_token_ids)
    rng = random.Random(11)
    cold = [] if args.cold == "none" else [int(n) for n in args.cold.split(",")]
    head = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    prompts = [head + [rng.randrange(3, vocab) for _ in range(n - len(head))] for n in cold]
    if cold:
        warm = [rng.randrange(3, vocab) for _ in range(max(cold))]
        asyncio.run(one(engine, warm, 2))   # the chunk shapes, once
        if args.profile:
            clock.profile, clock.profiling = cProfile.Profile(), True
        for i, ids in enumerate(prompts):
            clock.reset()
            line.reset()
            clock.on = line.on = True
            r = asyncio.run(one(engine, ids, 4))
            clock.on = line.on = False
            parts = {k: round(v * 1000, 1) for k, v in clock.total.items()}
            print(json.dumps({"what": "engine cold prompt", "i": i, "tokens": len(ids), **r,
                              "steps": clock.steps, "ms_total_by_part": parts, **memory()}),
                  flush=True)
            if args.timeline:   # each prompt chunk's launch, against the library's chunks
                print(json.dumps({"what": "timeline", "cold prompt": i, "columns": TIMELINE,
                                  "events": line.events[:60]}), flush=True)
        if args.repeat:   # the bench's order: the last of the longest, then a new turn on it
            ref = max(reversed(prompts), key=len)
            turn = ref + [rng.randrange(3, vocab) for _ in range(64)]
            for what, ids in (("engine exact repeat", ref), ("engine new turn", turn)):
                clock.reset()
                clock.on = True
                r = asyncio.run(one(engine, list(ids), 4))
                clock.on = False
                parts = {k: round(v * 1000, 1) for k, v in clock.total.items()}
                print(json.dumps({"what": what, "tokens": len(ids), **r, "steps": clock.steps,
                                  "ms_total_by_part": parts, **memory()}), flush=True)
        if clock.profile is not None:
            clock.profiling = False
            asyncio.run(one(engine, prompts[-1][:8], 2))
            s = io.StringIO()
            pstats.Stats(clock.profile, stream=s).sort_stats("cumtime").print_stats(40)
            print(s.getvalue(), flush=True)
            clock.profile = None
    if args.clear_after_cold:
        print(json.dumps({"what": "clear_cache after cold", **memory()}), flush=True)
        mx.clear_cache()
    bursts = {}
    for n in ([] if args.burst == "none" else [int(b) for b in args.burst.split(",")]):
        burst = bursts[n] = [[rng.randrange(3, vocab) for _ in range(76)] for _ in range(n)]
        for with_bias in (False, True):
            bias = {t: -100.0 for t in eos} if with_bias else {}
            asyncio.run(run_batch(engine, [[rng.randrange(3, vocab) for _ in range(76)]
                                           for _ in range(n)], 8, bias))
            for rep in range(args.reps):
                before = memory()
                clock.reset()
                line.reset()
                clock.on = line.on = True
                r = asyncio.run(run_batch(engine, [list(p) for p in burst], 8, bias))
                clock.on = line.on = False
                print(json.dumps({"what": "engine burst", "streams": n, "logit_bias": with_bias,
                                  "rep": rep, **r, "per_step_ms": clock.report(),
                                  "before": before, **memory()}), flush=True)
                if args.timeline:
                    print(json.dumps({"what": "timeline", "streams": n, "rep": rep,
                                      "logit_bias": with_bias, "columns": TIMELINE,
                                      "events": line.events[:40]}), flush=True)
    for shape in [s for s in args.shapes.split(",") if s]:
        n, width = (int(x) for x in shape.split("x"))
        prompts = [[rng.randrange(3, vocab) for _ in range(width)] for _ in range(n)]
        line.reset()
        clock.reset()
        line.on = clock.on = True
        r = asyncio.run(run_batch(engine, prompts, 4, {}))
        line.on = clock.on = False
        launches = [(e[2], e[3], e[4]) for e in line.events if e[0] == "launch"][:2]
        print(json.dumps({"what": "engine shape", "shape": shape, "ttft_p50_s": r["ttft_p50_s"],
                          "launches (ms, rows, prompt rows)": launches}), flush=True)
    if args.shared_head:
        system = [rng.randrange(3, vocab) for _ in range(args.shared_head)]
        for n, burst in bursts.items():
            asyncio.run(one(engine, system + [rng.randrange(3, vocab) for _ in range(76)], 4))
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            clock.reset()
            line.reset()
            clock.on = line.on = True
            r = asyncio.run(run_batch(engine, [system + p for p in burst], 4, {}))
            clock.on = line.on = False
            # the burst's own KV (every row's prompt and output), the unit of what it used
            rows_kv = n * (len(system) + 76 + 4) * engine.memory.kv_bytes_per_token
            print(json.dumps({"what": "engine burst on a cached head", "streams": n,
                              "head": len(system), **r, "per_step_ms": clock.report(),
                              **memory(), "rows_kv_gb": round(rows_kv / 1e9, 2),
                              "peak_above_start_x_rows_kv":
                                  round((mx.get_peak_memory() - base) / rows_kv, 2)}),
                  flush=True)
            if args.timeline:
                print(json.dumps({"what": "timeline", "streams": n, "head": len(system),
                                  "columns": TIMELINE, "events": line.events[:60]}), flush=True)
    model_dir = engine.loaded.path
    engine.stop()
    del engine
    mx.clear_cache()
    if args.library == "all" and cold:
        for r in library_cold(model_dir, prompts, warm, cfg.scheduler.prefill_chunk):
            print(json.dumps(r), flush=True)
    if args.library == "all" and bursts:
        for r in library(model_dir, bursts, 8, warm=1):
            print(json.dumps(r | {"max_tokens": 8}), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
