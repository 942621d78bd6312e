"""The KV bytes a prompt-cache hit allocates, stage by stage, counted with MLX's own memory
counters, the engine alone (no HTTP): a cold prompt of --prefix tokens, then (a) the same prompt
again (an exact repeat) and (b) that prompt plus --turn new tokens (a new turn). Every stage
that can copy KV is wrapped: the arrays it made are evaluated before the counters are read, so
each allocation lands in the stage that asked for it (the engine's overlap of host and device
is lost; its bytes are not). Printed as multiples of the prefix's KV size: `alloc` is the
stage's peak above what was live when it began (what it allocated, kept or not), `kept` what
stayed live after it; `ms` the stage's own time between its barriers (device work included).
Each case is first timed without the barriers (`ttft_s`, the engine's own overlap kept).

    python scripts/hit_copies.py --prefix 4096 -- model=tiny model.size=small \
        model.max_context=20000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from engine_alone import compose_cfg  # noqa: E402


def arrays(x: Any) -> list[mx.array]:
    """Every array in `x` (caches through their `state`, nested lists and tuples)."""
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in arrays(v)]
    if isinstance(x, dict):
        return [a for v in x.values() for a in arrays(v)]
    state = getattr(x, "state", None) if hasattr(x, "offset") or hasattr(x, "caches") else None
    if state is not None:
        return arrays(state)
    caches = getattr(x, "caches", None)
    if isinstance(caches, (list, tuple)):
        return arrays(list(caches))
    return []


class Counter:
    """Stage events (label, phase, alloc bytes, kept bytes), engine thread only; `phase` moves
    from "to first token" to "to the end" at the request's first token."""

    def __init__(self) -> None:
        self.on = False
        self.phase = "first"
        self.events: list[tuple[str, str, int, int, float]] = []
        self.stack: list[dict[str, int]] = []

    def measure(self, label: str, call: Callable[[], Any],
                before: Callable[[], list[mx.array]] = list,
                after: Callable[[Any], list[mx.array]] = arrays) -> Any:
        """Nested stages are counted on their own; the enclosing one's numbers leave them out
        (its alloc: its highest peak between them, above what was live when that stretch
        began; its kept: without what they kept)."""
        if not self.on:
            return call()
        mx.eval(before())
        mx.synchronize()
        a0 = mx.get_active_memory()
        if self.stack:   # the enclosing stage's stretch up to here
            outer = self.stack[-1]
            outer["alloc"] = max(outer["alloc"], mx.get_peak_memory() - outer["mark"])
        mx.reset_peak_memory()
        frame = {"inner": 0, "alloc": 0, "mark": a0, "inner_s": 0.0}
        t0 = time.perf_counter()
        self.stack.append(frame)
        try:
            out = call()
            mx.eval(after(out))
            mx.synchronize()
        finally:
            self.stack.pop()
        took = time.perf_counter() - t0
        live = mx.get_active_memory()
        alloc = max(frame["alloc"], mx.get_peak_memory() - frame["mark"])
        self.events.append((label, self.phase, alloc, live - a0 - frame["inner"],
                            took - frame["inner_s"]))
        if self.stack:
            self.stack[-1]["inner"] += live - a0
            self.stack[-1]["mark"] = live
            self.stack[-1]["inner_s"] += took
        mx.reset_peak_memory()
        return out

    def wrap(self, obj: Any, name: str, label: str,
             before: Callable[..., list[mx.array]] | None = None,
             after: Callable[..., list[mx.array]] | None = None) -> None:
        inner = getattr(obj, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            return self.measure(label, lambda: inner(*a, **k),
                                (lambda: before(*a, **k)) if before else list,
                                (lambda out: after(out, *a, **k)) if after else arrays)
        setattr(obj, name, wrapped)


def instrument(engine: Any, c: Counter) -> None:
    step, kv = engine.step, engine.step.kv
    import pipeserve.core.step as step_mod
    import pipeserve.prompt_cache.ram as ram_mod
    if engine.scheduler.lookup is not None:
        c.wrap(engine.scheduler, "lookup", "lookup (lend, trim, shrink)",
               after=lambda out, *a, **k: arrays(out.hit.caches if out.hit else None))
    import pipeserve.core.rows as rows_mod
    for mod in (step_mod, rows_mod):   # at adoption (a partial chunk) or when fed alone
        inner_reserve = mod.reserve
        mod.reserve = lambda caches, cap, _inner=inner_reserve: c.measure(
            "reserve (room for the next chunk)", lambda: _inner(caches, cap))
    c.wrap(kv, "decode_batch", "decode batch join (merge)",
           after=lambda out, *a, **k: arrays(out[0]))
    for cls in (KVCache, BatchKVCache):
        inner = cls.update_and_fetch

        def update(self: Any, keys: mx.array, values: mx.array, _inner: Any = inner,
                   _cls: Any = cls) -> Any:
            return c.measure(f"{_cls.__name__}.update (growth + write)",
                             lambda: _inner(self, keys, values),
                             lambda: [keys, values] + arrays(self),
                             lambda out: arrays(self))
        cls.update_and_fetch = update
    c.wrap(step, "prefill", "forward: the rest (activations, attention)",
           after=lambda out, *a, **k: [x for x in (out.logits,) if x is not None])
    c.wrap(step, "sample", "sample", after=lambda out, *a, **k: [out.token_ids])
    inner_own = ram_mod.own

    def own(layer: Any, pending: list[mx.array], *more: Any) -> Any:
        label = "put (own) " + ("prompt, drained" if c_state["where"] == "drain"
                                      else "finished row" if c_state["where"] == "finished"
                                      else "other")
        return c.measure(label, lambda: inner_own(layer, pending, *more),
                         after=lambda out: arrays(out[0]))
    ram_mod.own = own
    c_state = {"where": ""}

    def where(name: str, obj: Any, attr: str) -> None:
        inner = getattr(obj, attr)

        def call(*a: Any, **k: Any) -> Any:
            c_state["where"] = name
            try:
                return inner(*a, **k)
            finally:
                c_state["where"] = ""
        setattr(obj, attr, call)
    where("drain", step.persist, "drain")
    where("finished", step.persist, "_finished")
    c.wrap(kv, "release_many", "release (filter the batch)")
    out = engine._out
    inner_tokens = out.tokens

    def tokens(req: Any, event: Any, now: Any = None) -> None:
        inner_tokens(req, event, now)
        c.phase = "end"
    out.tokens = tokens


async def one(engine: Any, ids: list[int], max_tokens: int,
              first: list[float] | None = None) -> list[int]:
    from pipeserve.core.events import Failed, Finished, TokenDelta
    from pipeserve.core.stream import RequestStream
    from pipeserve.request import PromptInput, Request, SamplingParams
    req = Request(request_id=f"h-{uuid.uuid4().hex[:8]}", endpoint="bench",
                  inputs=PromptInput(token_ids=ids), prompt_ids=list(ids),
                  sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                  stop_token_ids=frozenset())
    stream = RequestStream(asyncio.get_running_loop())
    t0 = time.perf_counter()
    engine.submit(req, stream)
    got: list[int] = []
    while True:
        event = await stream.next()
        if isinstance(event, TokenDelta):
            if first is not None and not got:
                first.append(time.perf_counter() - t0)
            got.extend(event.token_ids)
        elif isinstance(event, Finished):
            return got
        else:
            assert isinstance(event, Failed)
            raise event.error


def table(events: list[tuple[str, str, int, int, float]], unit: float) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], list[float]] = {}
    for label, phase, alloc, kept, took in events:
        r = rows.setdefault((phase, label), [0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += alloc / unit
        r[2] += kept / unit
        r[3] += took * 1000
    return [{"phase": p, "stage": s, "calls": n, "alloc_x": round(a, 2), "kept_x": round(k, 2),
             "ms": round(ms, 1)} for (p, s), (n, a, k, ms) in rows.items()
            if abs(a) >= 0.01 or abs(k) >= 0.01 or ms >= 0.5]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_cfg(args.overrides, strict=False)   # MLX is imported: graphs as set outside
    from pipeserve.core.engine import Engine
    from pipeserve.metrics import Metrics
    engine = Engine(cfg, Metrics(CollectorRegistry()))
    engine.start()
    assert engine.wait_ready(300), engine.startup_error
    c = Counter()
    instrument(engine, c)
    rng = random.Random(0)
    vocab = 200
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    turn = prefix + [rng.randrange(3, vocab) for _ in range(args.turn)]
    asyncio.run(one(engine, [5, 6, 7, 8] * 8, 2))
    asyncio.run(one(engine, prefix, args.max_tokens))   # cold: the entry every hit lends
    time.sleep(0.5)
    entry = max(engine.step._cache.entries.values(), key=lambda e: len(e.tokens))
    unit = sum(a.nbytes for a in arrays(entry.caches)) / len(entry.tokens) * args.prefix
    del entry   # (it would outlive its replacement)
    print(json.dumps({"prefix_tokens": args.prefix, "prefix_kv_bytes": int(unit),
                      "overrides": args.overrides}))
    for name, ids in (("exact repeat", prefix), ("new turn", turn)):
        plain: list[float] = []
        for k in range(2):   # no barriers: what a client waits for
            tail = [] if name == "exact repeat" else [rng.randrange(3, vocab) for _ in range(8)]
            asyncio.run(one(engine, ids[:-8] + tail if tail else ids, args.max_tokens, plain))
            time.sleep(0.3)
        print(json.dumps({"case": name, "ttft_s": [round(t, 4) for t in plain]}))
        c.events, c.phase, c.on = [], "first", True
        mx.reset_peak_memory()
        a0 = mx.get_active_memory()
        asyncio.run(one(engine, ids, args.max_tokens))
        time.sleep(0.5)
        c.on = False
        live = mx.get_active_memory()
        asyncio.run(one(engine, [9, 10, 11] * 8, 2))   # drops what the last plan held
        time.sleep(0.3)
        print(json.dumps({"case": name, "live_after_x": round((live - a0) / unit, 2),
                          "after_another_x": round((mx.get_active_memory() - a0) / unit, 2)}))
        for row in table(c.events, unit):
            print(json.dumps({"case": name, **row}))
        print(json.dumps({"case": name, "stage": "TOTAL", "alloc_x": round(
            sum(e[2] for e in c.events) / unit, 2), "ms": round(1000 * sum(
            e[4] for e in c.events if e[1] == "first"), 1), "live_after_x": round(
            (mx.get_active_memory() - a0) / unit, 2), "entries": [
            (len(e.tokens), round(e.nbytes / unit, 2))
            for e in engine.step._cache.entries.values()]}))
    engine.stop()
    sys.stdout.flush()
    os._exit(0)   # the engine thread's MLX teardown at interpreter exit aborts


if __name__ == "__main__":
    main()
