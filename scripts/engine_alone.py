"""The engine alone, no HTTP: real `Engine.submit` with `RequestStream`s (as the test harness
drives it), on any model the serve config names, next to mlx-lm's own loops on the same weights
in the same process. Prints one JSON object per measurement, and a per-step breakdown of the
engine thread (schedule / launch / read-back / apply / flush, ms a step), so each loss is
attributed to host work or to the device: `host` is the loop's own Python a step, its parts
less the waits on the device (the read-back, and mx.async_eval, which on the CPU backend runs
the step). Where it exceeds the device's time a step, the device waits on the host.

    python scripts/engine_alone.py --streams 1,32,128 -- model=tiny model.size=large \
        model.dtype=bfloat16 model.compute_dtype=checkpoint
    python scripts/engine_alone.py --profile 1 --library none -- model=tiny

--bias both: every measurement with and without a logit_bias on every request (EOS -100; the
rows have no stop tokens either way, so both run to --max-tokens). --profile N: cProfile the
engine thread during the N-stream run (top functions by own time). --loop uvloop: the streams
on the event loop the server runs (asyncio's by default). --spread S: each measurement's
streams arrive evenly over S seconds, as an HTTP burst's do, instead of all at once.
scheduler.step_trace=true: the engine's step lines on stderr (bench.py keeps them in
engine-alone-N.log; summarized by scripts/request_log_bursts.py --steps-only). Used by bench.py
for its `engine alone` rows (bench.engine_alone=true)."""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import io
import os
import json
import logging
import pstats
import random
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from pipeserve.config import check_overrides, load_config, register_configs  # noqa: E402
from pipeserve.launch.logs import formatter  # noqa: E402
from pipeserve.model.mlx_env import use_cuda_graphs  # noqa: E402


class StepClock:
    """Wall time the engine thread spends in each part of its loop, per step."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.on = False
        self.profile: cProfile.Profile | None = None
        self.profiling = False
        self.enabled = False

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if self.on:
                    self.total[label] += time.perf_counter() - t0
        setattr(obj, name, timed)

    def reset(self) -> None:
        self.total.clear()
        self.steps = 0

    def report(self) -> dict[str, float]:
        n = max(self.steps, 1)
        t = self.total
        t["dispatch (late)"] += 0.0   # reported (as 0) when every dispatch ran inside launch
        # the loop's own Python per step: its parts, less the waits on the device in them
        host = (t["schedule"] + t["launch"] + t["apply (incl. read)"] + t["flush"] + t["passed"]
                - t["dispatch (in launch)"] - t["read"])
        return {k: round(1000 * v / n, 3) for k, v in sorted(t.items())} | {
            "host": round(1000 * host / n, 3), "steps": self.steps}


def compose_cfg(overrides: list[str], strict: bool = True) -> Any:
    """The serve config of `overrides`, with MLX's environment set from it (server.cuda_graphs);
    strict: fail where MLX was imported first, so that setting could not take effect."""
    register_configs()
    check_overrides(overrides)
    with initialize_config_dir(config_dir=str(ROOT / "pipeserve" / "conf"), version_base="1.3"):
        raw = compose("serve", overrides=overrides)
        # as serve.py: before MLX is imported, or the setting would be silently ignored
        # (round 16's engine-alone rows all ran MLX's default, graphs on, whatever it said)
        if use_cuda_graphs(raw.server.get("cuda_graphs")) is None and strict:
            raise SystemExit("compose_cfg: mlx.core is imported already, so server.cuda_graphs "
                             "cannot take effect; compose the config before importing MLX")
        return load_config(raw)


def instrument(engine: Any, clock: StepClock) -> None:
    """Timers around the loop's parts (instance attributes: the class is untouched)."""
    sched = engine.scheduler
    inner_schedule = sched.schedule

    def schedule() -> Any:
        if clock.on:
            clock.steps += 1
        if clock.profile is not None:   # engine thread: enable/disable here, once each
            want = clock.profiling and clock.on
            if want != clock.enabled:
                (clock.profile.enable if want else clock.profile.disable)()
                clock.enabled = want
        t0 = time.perf_counter()
        plan = inner_schedule()
        if clock.on:
            clock.total["schedule"] += time.perf_counter() - t0
        return plan
    sched.schedule = schedule
    clock.wrap(engine.step, "launch", "launch")
    # mx.async_eval: on the CPU backend it runs the step itself; late (dispatch_late) it is
    # outside launch and counted apart
    inner_launch, inner_dispatch = engine.step.launch, engine.step.dispatch
    inside = [False]

    def launch(*a: Any) -> Any:
        inside[0] = True
        try:
            return inner_launch(*a)
        finally:
            inside[0] = False

    def dispatch(launched: Any) -> Any:
        if launched.queued is None:   # already handed over (the loop's late call is then a no-op)
            return inner_dispatch(launched)
        t0 = time.perf_counter()
        try:
            return inner_dispatch(launched)
        finally:
            if clock.on:
                clock.total["dispatch (in launch)" if inside[0] else "dispatch (late)"] += (
                    time.perf_counter() - t0)
    engine.step.launch, engine.step.dispatch = launch, dispatch
    clock.wrap(engine.step, "read", "read")
    clock.wrap(engine, "_apply", "apply (incl. read)")
    clock.wrap(engine._out, "flush", "flush")
    clock.wrap(engine.step, "passed", "passed")


async def run_batch(engine: Any, prompts: list[list[int]], max_tokens: int,
                    bias: dict[int, float], spread_s: float = 0.0) -> dict[str, Any]:
    """Every prompt as a stream; with `spread_s`, the i-th of n submits i/n of it after the
    first (arrivals as spread as an HTTP burst's). TTFT counts from each one's own submit."""
    from pipeserve.core.events import Failed, Finished, TokenDelta
    from pipeserve.request import PromptInput, Request, SamplingParams
    from pipeserve.core.stream import RequestStream
    from pipeserve.bench import host
    loop = asyncio.get_running_loop()
    probe, steal0 = host.probe_ms(), host.steal_s()
    t0 = time.perf_counter()

    async def one(i: int, ids: list[int]) -> tuple[float, float, int, int, float]:
        if spread_s:
            await asyncio.sleep(spread_s * i / len(prompts))
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=dict(bias))
        req = Request(request_id=f"b-{uuid.uuid4().hex[:8]}", endpoint="bench",
                      inputs=PromptInput(token_ids=ids), prompt_ids=list(ids), sampling=sp,
                      stop_token_ids=frozenset())
        stream = RequestStream(loop)
        sent = time.perf_counter()
        engine.submit(req, stream)
        first = last = 0.0
        n = 0
        while True:
            event = await stream.next()
            if isinstance(event, TokenDelta):
                last = time.perf_counter()
                first = first or last
                n += len(event.token_ids)
            elif isinstance(event, Finished):
                return first, last, n, req.num_cached_tokens, sent
            else:
                assert isinstance(event, Failed)
                raise event.error
    got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    end = max(g[1] for g in got)
    tokens = sum(g[2] for g in got)
    ttft = sorted(g[0] - g[4] for g in got)
    single = got[0]
    return {"tokens": tokens, "cached_tokens": sum(g[3] for g in got),
            "wall_s": round(end - t0, 3),
            "agg_tok_s": round(tokens / (end - t0), 1),
            "decode_tok_s_row": round((single[2] - 1) / (single[1] - single[0]), 1)
            if single[1] > single[0] else None,
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4),
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 4),
            "ttft_last_s": round(got[-1][0] - got[-1][4], 4),   # the last one submitted
            "host_steal": round((host.steal_s() - steal0) / (end - t0), 3),
            "host_probe_ms": probe}


def library(model_dir: Path, prompts_by_n: dict[int, list[list[int]]], max_tokens: int,
            warm: int) -> list[dict[str, Any]]:
    """mlx-lm's bare generate_step loop (1 stream) and BatchGenerator (n streams)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, generate_step
    from pipeserve.model.config import ComputeDType, ModelConfig
    from pipeserve.model.loader import _cast_weights
    model, _ = load(str(model_dir))
    _cast_weights(model, ModelConfig(compute_dtype=ComputeDType("checkpoint")))
    out = []
    for n, prompts in sorted(prompts_by_n.items()):
        if n == 1:
            for rep in range(warm + 2):
                stamps = []
                for _tok, _ in generate_step(mx.array(prompts[0]), model, max_tokens=max_tokens):
                    stamps.append(time.perf_counter())
                if rep >= warm:
                    out.append({"what": "library bare loop", "streams": 1, "rep": rep - warm,
                                "decode_tok_s_row": round((len(stamps) - 1)
                                                          / (stamps[-1] - stamps[0]), 1)})
            continue
        for rep in range(warm + 1):
            gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=n,
                                 prefill_batch_size=n)
            t0 = time.perf_counter()
            uids = gen.insert(prompts, [max_tokens] * n)
            first: dict[int, float] = {}
            count = 0
            done = 0
            decoding: list[float] = []   # batch times from the last first token on
            after = 0
            while done < len(uids):
                res = gen.next_generated()
                if not res:
                    break
                now = time.perf_counter()
                everyone = len(first) == len(uids)
                for r in res:
                    first.setdefault(r.uid, now)
                    count += 1
                    done += r.finish_reason is not None
                if everyone:
                    after += len(res)
                    decoding.append(now)
                elif len(first) == len(uids):
                    decoding.append(now)   # the decode part starts at the last first token
            wall = time.perf_counter() - t0
            gen.close()
            if rep >= warm:
                ttft = sorted(v - t0 for v in first.values())
                span = decoding[-1] - decoding[0] if len(decoding) > 1 else 0.0
                out.append({"what": "library BatchGenerator", "streams": n,
                            "agg_tok_s": round(count / wall, 1), "wall_s": round(wall, 3),
                            "ttft_p50_s": round(ttft[len(ttft) // 2], 4),
                            # its decode alone: tokens after every row's first, over their time
                            "decode_agg_tok_s": round(after / span, 1) if span else None})
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=76)
    ap.add_argument("--lengths", default="", help="each timed prompt's length (the server "
                    "run's, one a stream; default: --prompt-tokens each)")
    ap.add_argument("--warm-lengths", default="", help="the warm-up prompts' lengths (the "
                    "server run's warm-up; default: --prompt-tokens, one a stream)")
    ap.add_argument("--follow-up", action="store_true",
                    help="each timed prompt is an untimed first turn (--warm-lengths, sent just "
                         "before) plus --lengths new tokens: a burst of prompt-cache hits, as "
                         "agents' next turns (a first turn shorter than "
                         "cache.min_reuse_tokens, 256 on a GPU, is computed again)")
    ap.add_argument("--bias", choices=["both", "on", "off"], default="both")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="seconds over which a measurement's streams arrive (evenly; an HTTP "
                         "burst's spread, from request_log_bursts.py's arrival_spread_s)")
    ap.add_argument("--library", choices=["all", "none"], default="all")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="cProfile the N-stream run")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"],
                    default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
                    help="the streams' event loop (default: the server's, uvloop under Sanic; "
                         "asyncio's wakes by a socket send that releases the GIL, uvloop's not)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_cfg(args.overrides)   # first: it sets MLX's environment
    if cfg.scheduler.step_trace:   # the engine's step lines on stderr, as a server logs them
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter("text"))
        steps = logging.getLogger("pipeserve.steps")
        steps.addHandler(handler)
        steps.setLevel(logging.INFO)
    from pipeserve.core.engine import Engine
    from pipeserve.metrics import Metrics
    sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)   # as the server sets it
    engine = Engine(cfg, Metrics(CollectorRegistry()))
    clock = StepClock()
    t0 = time.perf_counter()
    engine.start()
    assert engine.wait_ready(1800), f"engine failed: {engine.startup_error!r}"
    instrument(engine, clock)   # the step exists once loaded; nothing is scheduled yet
    import mlx.core as mx
    print(json.dumps({"what": "loaded", "s": round(time.perf_counter() - t0, 1),
                      "device": str(mx.default_device()), "model": str(engine.loaded.path),
                      "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "1")}),
          flush=True)
    vocab = min(engine.loaded.tokenizer.vocab_size, 500)
    eos = sorted(engine.loaded.tokenizer.eos_token_ids)
    rng = random.Random(7)
    streams = [int(s) for s in args.streams.split(",")]
    def ids(lengths: str, n: int) -> list[list[int]]:
        """Random prompts: as long as `lengths` says (cycled to n), or --prompt-tokens each."""
        sizes = [int(x) for x in lengths.split(",") if x] or [args.prompt_tokens]
        return [[rng.randrange(3, vocab) for _ in range(sizes[i % len(sizes)])]
                for i in range(n)]
    prompts_by_n = {n: ids(args.lengths, n) for n in streams}
    biases = {"on": [True], "off": [False], "both": [True, False]}[args.bias]
    run = asyncio.run
    if args.loop == "uvloop":
        import uvloop
        run = uvloop.run
    for n in streams:
        for with_bias in biases:
            bias = {t: -100.0 for t in eos} if with_bias else {}
            warm = ids(args.warm_lengths, n)
            run(run_batch(engine, warm, 16, bias))   # kernels for these shapes
            for rep in range(args.reps):
                # a rep after the first sends new prompts of the same lengths: the same shapes,
                # no prompt-cache hit (as a stream's next request through HTTP)
                prompts = prompts_by_n[n] if rep == 0 else [
                    [rng.randrange(3, vocab) for _ in p] for p in prompts_by_n[n]]
                if args.follow_up:   # the first turns, cached, then the timed next turns
                    first = ids(args.warm_lengths, n)
                    run(run_batch(engine, first, 16, bias))
                    prompts = [f + p for f, p in zip(first, prompts)]
                clock.reset()
                clock.on = True
                if args.profile == n and rep == 0 and with_bias == biases[0]:
                    clock.profile, clock.profiling = cProfile.Profile(), True
                r = run(run_batch(engine, prompts, args.max_tokens, bias, args.spread))
                clock.on = False
                clock.profiling = False
                r |= {"what": "engine alone", "streams": n, "logit_bias": with_bias,
                      "prompt_tokens": [len(p) for p in prompts],
                      "loop": args.loop, "spread_s": args.spread, "rep": rep,
                      "per_step_ms": clock.report()}
                print(json.dumps(r), flush=True)
                if clock.profile is not None:
                    run(run_batch(engine, warm[:1], 2, {}))   # disables it, in-thread
                    s = io.StringIO()
                    pstats.Stats(clock.profile, stream=s).sort_stats(os.environ.get("EA_SORT", "tottime")).print_stats(int(os.environ.get("EA_TOP", "35")))
                    print(s.getvalue(), flush=True)
                    clock.profile = None
    model_dir = engine.loaded.path
    engine.stop()
    del engine
    mx.clear_cache()
    if args.library == "all":
        for r in library(model_dir, prompts_by_n, args.max_tokens, warm=1):
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # as serve.py: MLX's C++ thread state can abort during interpreter teardown
