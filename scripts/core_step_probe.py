"""Where one stream's step time goes in each engine core placement (issue 39): the engine in
this process (`thread`, as the server's thread core) and in a child process (`process`, the
pool's ChildEngine and pipeserve/pool/child.py, as server.isolate=true), driven with no HTTP by
RequestStreams on an event loop here. Per placement, one JSON line:

  engine: the engine thread's loop pass (wall and thread CPU time, p50 ms), and inside it the
          launch (graph build, sampling; with the async_eval unless dispatch_late), the
          async_eval and the read-back (tolist) — wall time the thread spends outside Python
          (device waits, the GIL) is wall minus CPU;
  chain:  one token from the engine's post to the consumer (p50 ms), split for the process core
          into engine post → on the pipe → parent reader → event loop;
  stream: the consumer's decode tok/s and inter-token gap p50 (ms).

    python scripts/core_step_probe.py --streams 1 --reps 3 -- model=tiny
    python scripts/core_step_probe.py --placements process --loop asyncio -- model=tiny \
        model.size=large model.dtype=bfloat16 model.compute_dtype=checkpoint

The clocks are time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for both processes)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TRACE_ENV = "PIPESERVE_PROBE_TRACE"   # the child's file for its pass and message records


def instrument_engine(records: dict[str, list[Any]]) -> None:
    """Class-level timers on the engine's step (this process): every loop pass's wall and CPU
    time with its launch, async_eval and read-back; every flush's time."""
    from pipeserve.core.outbox import Outbox
    from pipeserve.core.step import Step
    cur: dict[str, float] = {"launch": 0.0, "dispatch": 0.0, "read": 0.0}
    last = {"wall": time.perf_counter(), "cpu": time.thread_time()}

    def timed(name: str, inner: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                cur[name] += time.perf_counter() - t0
        return call
    launch, dispatch, read = Step.launch, Step.dispatch, Step.read
    Step.launch = timed("launch", launch)
    Step.dispatch = staticmethod(timed("dispatch", dispatch))
    Step.read = staticmethod(timed("read", read))
    passed, flush = Step.passed, Outbox.flush

    def passed_(self: Any) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        records["passes"].append([now, now - last["wall"], cpu - last["cpu"], cur["launch"],
                                  cur["dispatch"], cur["read"]])
        last["wall"], last["cpu"] = now, cpu
        cur.update(launch=0.0, dispatch=0.0, read=0.0)
        passed(self)

    def flush_(self: Any) -> None:
        if self._pending:
            records["flush"].append(time.perf_counter())
        flush(self)
    Step.passed, Outbox.flush = passed_, flush_


def probe_child_main(conn: Any, cfg: Any, model_id: str, adapters: Any = None) -> None:
    """pipeserve/pool/child.py main, with the engine's timers and each step message numbered
    (`seq`) and stamped when the engine posted it (`tf`); the Sender's writes are stamped here
    and every record goes to $PIPESERVE_PROBE_TRACE whenever a request finishes."""
    from pipeserve.core.events import Finished
    from pipeserve.pool import child
    records: dict[str, list[Any]] = {"passes": [], "flush": [], "written": []}
    instrument_engine(records)
    seq = [0]
    post, send, init = (child.PipeLoop.call_soon_threadsafe, child.Sender.send,
                        child.Sender.__init__)

    def call_soon_threadsafe(self: Any, deliver: Any, batch: list[Any]) -> None:
        if any(isinstance(e, Finished) for _, e in batch):   # on file before the parent asks
            out = Path(os.environ[TRACE_ENV])
            out.with_suffix(".tmp").write_text(json.dumps(records))
            os.replace(out.with_suffix(".tmp"), out)
        outer = self.send

        def numbered(message: dict[str, Any]) -> None:
            seq[0] += 1
            outer({**message, "seq": seq[0]})
        self.send = numbered
        try:
            post(self, deliver, batch)
        finally:
            self.send = outer

    def send_(self: Any, message: dict[str, Any]) -> None:
        send(self, message)
        if "seq" in message and getattr(self, "_backlog", 1) == 0:   # written here, directly
            records["written"].append([message["seq"], time.perf_counter(), True])

    class StampedConn:
        """The Sender thread's writes, stamped once on the pipe."""

        def __init__(self, conn: Any) -> None:
            self._conn = conn

        def fileno(self) -> int:
            return self._conn.fileno()

        def send_bytes(self, data: bytes) -> None:
            self._conn.send_bytes(data)
            got = child.codec.loads(data)
            if "seq" in got:
                records["written"].append([got["seq"], time.perf_counter(), False])

    def init_(self: Any, conn: Any) -> None:
        init(self, StampedConn(conn))
    child.PipeLoop.call_soon_threadsafe = call_soon_threadsafe
    child.Sender.send, child.Sender.__init__ = send_, init_
    child.main(conn, cfg, model_id, adapters)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def ms(x: float) -> float:
    return round(1000 * x, 3)


async def consume(engine: Any, prompts: list[list[int]], max_tokens: int,
                  bias: dict[int, float], seen: list[tuple[str, float, int]]) -> None:
    from pipeserve.core.events import Failed, Finished, TokenDelta
    from pipeserve.core.stream import RequestStream
    from pipeserve.request import PromptInput, Request, SamplingParams
    loop = asyncio.get_running_loop()

    async def one(ids: list[int]) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=dict(bias))
        rid = f"p-{uuid.uuid4().hex[:8]}"
        req = Request(request_id=rid, endpoint="bench", inputs=PromptInput(token_ids=ids),
                      prompt_ids=list(ids), sampling=sp, stop_token_ids=frozenset())
        stream = RequestStream(loop)
        engine.submit(req, stream)
        while True:
            event = await stream.next()
            if isinstance(event, TokenDelta):
                seen.append((rid, time.perf_counter(), len(event.token_ids)))
            elif isinstance(event, Finished):
                return
            else:
                assert isinstance(event, Failed)
                raise event.error
    await asyncio.gather(*(one(p) for p in prompts))


def summarize(seen: list[tuple[str, float, int]], passes: list[list[float]]) -> dict[str, Any]:
    first_rid = seen[0][0]
    mine = [t for rid, t, _ in seen if rid == first_rid]
    gaps = [b - a for a, b in zip(mine, mine[1:])]
    t0, t1 = mine[0], mine[-1]
    window = [p for p in passes if t0 <= p[0] <= t1]
    out: dict[str, Any] = {
        "decode_tok_s_row": round((len(mine) - 1) / (t1 - t0), 1) if t1 > t0 else None,
        "itl_p50_ms": ms(percentile(gaps, 0.5)), "itl_p95_ms": ms(percentile(gaps, 0.95)),
        "tokens": sum(n for _, _, n in seen)}
    if window:
        cols = list(zip(*window))
        out["engine_pass_ms"] = {k: ms(percentile(list(v), 0.5)) for k, v in
                                 zip(["wall", "cpu", "launch", "async_eval", "read"], cols[1:])}
        out["engine_passes"] = len(window)
    return out


def run_placement(placement: str, cfg: Any, args: Any, prompts_by_rep: list[list[list[int]]],
                  bias: dict[int, float]) -> None:
    from prometheus_client import CollectorRegistry
    from pipeserve.metrics import Metrics
    records: dict[str, list[Any]] = {"passes": [], "flush": []}
    recv: dict[int, float] = {}
    sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)   # as the server sets it
    if placement == "thread":
        from pipeserve.core.engine import Engine
        instrument_engine(records)
        engine: Any = Engine(cfg, Metrics(CollectorRegistry()))
    else:
        from pipeserve.pool import child, proxy
        trace = Path(args.trace_dir) / f"child-{os.getpid()}.json"
        os.environ[TRACE_ENV] = str(trace)
        child.main = probe_child_main   # the spawn target: patched in the child, not here
        engine = proxy.ChildEngine("probe", cfg, Metrics(CollectorRegistry()))
        events = proxy.ChildEngine._events

        def events_(self: Any, msgs: list[dict[str, Any]]) -> None:
            now = time.perf_counter()
            for m in msgs:
                recv[m["seq"]] = now
            events(self, msgs)
        proxy.ChildEngine._events = events_   # type: ignore[method-assign]
    t0 = time.perf_counter()
    engine.start()
    assert engine.wait_ready(1800), f"engine failed: {engine.startup_error!r}"
    print(json.dumps({"placement": placement, "loaded_s": round(time.perf_counter() - t0, 1)}),
          flush=True)
    runner = asyncio.run
    if args.loop == "uvloop":
        import uvloop
        runner = uvloop.run
    warm = [[random.Random(1).randrange(3, 400) for _ in range(args.prompt_tokens)]
            for _ in range(len(prompts_by_rep[0]))]
    runner(consume(engine, warm, 16, bias, []))
    for rep, prompts in enumerate(prompts_by_rep):
        seen: list[tuple[str, float, int]] = []
        runner(consume(engine, prompts, args.max_tokens, bias, seen))
        passes = records["passes"]
        row = {"placement": placement, "loop": args.loop, "streams": len(prompts), "rep": rep}
        if placement == "process":
            got = json.loads(Path(os.environ[TRACE_ENV]).read_text())
            passes = got["passes"]
            row |= summarize(seen, passes)
            row["chain_ms"] = chain(got, recv, seen)
        else:
            row |= summarize(seen, passes)
            row["chain_ms"] = {"post_to_consumer": ms(percentile(
                thread_chain(records["flush"], seen), 0.5))}
        print(json.dumps(row), flush=True)
    engine.stop()
    if placement == "process":
        Path(os.environ[TRACE_ENV]).unlink(missing_ok=True)


def thread_chain(flushes: list[float], seen: list[tuple[str, float, int]]) -> list[float]:
    """Each consumed token's delay after the engine's last flush before it."""
    import bisect
    out = []
    for _, t, _ in seen:
        i = bisect.bisect_right(flushes, t) - 1
        if i >= 0:
            out.append(t - flushes[i])
    return out


def chain(got: dict[str, Any], recv: dict[int, float],
          seen: list[tuple[str, float, int]]) -> dict[str, Any]:
    """Per step message of the measured run: engine post (its flush) → on the pipe → parent
    reader; then each consumed token after the parent's last read before it."""
    import bisect
    flushes = got["flush"]
    t_first = seen[0][1] - 0.05
    part: dict[str, list[float]] = {"post_to_pipe": [], "pipe_to_parent": []}
    direct = []
    for s, t, is_direct in got["written"]:
        if s not in recv or recv[s] < t_first:
            continue
        i = bisect.bisect_right(flushes, t) - 1
        if i >= 0:
            part["post_to_pipe"].append(t - flushes[i])
        part["pipe_to_parent"].append(recv[s] - t)
        direct.append(is_direct)
    reads = sorted(recv.values())
    part["parent_to_consumer"] = thread_chain(reads, seen)
    part["post_to_consumer"] = thread_chain(flushes, seen)
    out: dict[str, Any] = {k: ms(percentile(v, 0.5)) for k, v in part.items()}
    out["direct_share"] = round(sum(direct) / max(len(direct), 1), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--placements", default="thread,process")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=76)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop",
                    help="the consumer's event loop (the server runs uvloop under Sanic)")
    ap.add_argument("--trace-dir", default="/tmp")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from engine_alone import compose_cfg
    cfg = compose_cfg(args.overrides)
    rng = random.Random(7)
    prompts_by_rep = [[[rng.randrange(3, 400) for _ in range(args.prompt_tokens)]
                       for _ in range(args.streams)] for _ in range(args.reps)]
    from pipeserve.model.loader import resolve_path
    eos = _eos(resolve_path(cfg.model))
    bias = {t: -100.0 for t in eos}
    for placement in args.placements.split(","):
        run_placement(placement, cfg, args, prompts_by_rep, bias)


def _eos(model_dir: Path) -> list[int]:
    ids = json.loads((model_dir / "config.json").read_text()).get("eos_token_id") or []
    return ids if isinstance(ids, list) else [ids]


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # as serve.py: MLX's C++ thread state can abort during interpreter teardown
