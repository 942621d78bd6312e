"""The rows that bypass HTTP: the bare mlx-lm loop, its BatchGenerator, the engine alone and
the step probe, each run in a child process on the same model directory."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from pipeserve.bench.config import BenchConfig, Row
from pipeserve.bench.server import ROOT
from pipeserve.bench.tables import _write, sweep_continues
from pipeserve.bench.workload import _prompts
from pipeserve.config import ServeConfig

BARE_LOOP = r"""
import sys, time, json
path, prompt, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if mode == "served":   # the compute pipeserve serves with: its BLAS and compute dtype
    from pipeserve.model.config import ModelConfig, ComputeDType
    from pipeserve.model.loader import _cast_weights
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
# the prompts on stdin: 128 streams of 620-token prompts overflow one argument (128 KiB)
path, prompts, n, mode = sys.argv[1], json.load(sys.stdin), int(sys.argv[2]), sys.argv[3]
if mode == "served":
    from pipeserve.model.config import ModelConfig, ComputeDType
    from pipeserve.model.loader import _cast_weights
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
model, tok = load(path)
if mode == "served":
    _cast_weights(model, ModelConfig(compute_dtype=ComputeDType(sys.argv[4])))
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
from pipeserve.model.config import ModelConfig, ComputeDType   # first: interposes the CPU BLAS
from pipeserve.kv import attention
from pipeserve.model.loader import _cast_weights
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


def _engine_alone(b: BenchConfig, overrides: list[str], model_dir: Path,
                  prompt_tokens: float, out: Path, spread_s: float | None = None) -> Row:
    """The engine with no HTTP around it (one process, pipeserve's own config): random prompt
    ids as long as the server's prompts were, each one (warm-up and timed, from the server
    run's prompt-lengths.json), so both meet the same shapes cold or warm; greedy, logit_bias
    suppressing EOS. Its streams are read on the event loop the server runs (engine_alone.py's
    default: uvloop where it is installed). `spread_s`: the streams arrive evenly over that
    long (engine_alone.py --spread), as an HTTP burst's did."""
    n = round(prompt_tokens) if prompt_tokens == prompt_tokens else b.prompt_words
    lengths = out / "prompt-lengths.json"
    given = []
    if lengths.is_file():
        seen = json.loads(lengths.read_text())
        if all(isinstance(x, int) for x in seen["warm"] + seen["timed"]):
            given = ["--lengths", ",".join(map(str, seen["timed"])),
                     "--warm-lengths", ",".join(map(str, seen["warm"]))]
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_alone.py"),
                          "--streams", str(b.streams), "--max-tokens", str(b.max_tokens),
                          "--prompt-tokens", str(n), *given, "--bias", "on", "--library", "none",
                          "--reps", str(b.requests_per_stream),
                          *(["--spread", str(spread_s)] if spread_s else []),
                          "--", *overrides, f"model.path={model_dir}"],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=b.timeout_s)
    name = f"engine-alone-{b.streams}" + ("-spread" if spread_s else "")
    with open(out / f"{name}.log", "a" if sweep_continues() else "w") as log:
        log.write(res.stderr)   # step lines where traced; a sweep's jobs one after another
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    reps = [g for g in got if g.get("what") == "engine alone"]
    # bench.requests_per_stream batches in a row, as each stream's requests go through HTTP:
    # the aggregate over all of them, the medians of the per-batch rates and TTFTs
    tokens, wall = sum(r["tokens"] for r in reps), sum(r["wall_s"] for r in reps)
    rates = [r["decode_tok_s_row"] for r in reps if r["decode_tok_s_row"]]
    target = "pipeserve engine alone" + (", HTTP's arrivals" if spread_s else "")
    row = Row(target, b.workload, b.streams, b.streams * len(reps), tokens,
              round(wall, 3), round(tokens / wall, 1),
              statistics.median(rates) if rates else float("nan"),
              statistics.median(r["ttft_p50_s"] for r in reps),
              max(r["ttft_p95_s"] for r in reps), float("nan"), float("nan"), float("nan"))
    row.prompt_tokens = statistics.mean(reps[0]["prompt_tokens"])
    row.host_steal = statistics.median(r["host_steal"] for r in reps)
    row.host_probe_ms = statistics.median(r["host_probe_ms"] for r in reps)
    return row


def _batch_generator(b: BenchConfig, cfg: ServeConfig, model_dir: Path) -> Row:
    """The same prompts, all at once, through mlx-lm's BatchGenerator in one process: the
    library's batched rate with no server, HTTP or detokenizing around it, computing in the
    dtype pipeserve serves (model.compute_dtype; on a GPU that is the checkpoint's)."""
    prompts = _prompts(b)
    res = subprocess.run([sys.executable, "-c", BATCH_GEN, str(model_dir),
                          str(b.max_tokens), "served", cfg.model.compute_dtype.value],
                         input=json.dumps(prompts), capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=b.timeout_s)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    row = Row("mlx-lm BatchGenerator", b.workload, b.streams, len(prompts), r["tokens"],
              round(r["wall"], 2), round(r["tokens"] / r["wall"], 2), float("nan"),
              round(r["ttft_p50"], 3), round(r["ttft_p95"], 3), float("nan"), float("nan"),
              float("nan"))
    row.prompt_tokens = round(r["prompt_tokens"], 1)
    row.decode_full_tok_s = round(r["full"], 2)
    return row


def arrival_spread(log: Path, streams: int) -> float | None:
    """How long the last burst of `streams` requests in a server's log took to arrive (the
    timed one: warm-ups come first), by scripts/request_log_bursts.py; None without one."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "request_log_bursts.py"),
                          str(log)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    bursts = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    timed = [x for x in bursts if x["requests"] == streams]
    return float(timed[-1]["arrival_spread_s"]) if timed else None
