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
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeserve.bench.config import CORES, BenchConfig, BenchRootConfig, Row
from pipeserve.bench.library import (
    BARE_LOOP,
    _batch_generator,
    _engine_alone,
    _step_probe,
    arrival_spread,
)
from pipeserve.bench.server import (
    ROOT,
    Process,
    _free_port,
    _gauge,
    _get,
    _peak_rss_mb,
    _ranks,
    _with_children,
    thread_cpu,
)
from pipeserve.bench.tables import _new_tables, _row, _write, sweep_continues
from pipeserve.bench.workload import _prompts, _single, _words, drive
from pipeserve.config import load_config, register_configs
from pipeserve.model.cache import release_mlx_buffers
from pipeserve.model.config import ModelSource
from pipeserve.model.tiny.assistant import ensure_assistant
from pipeserve.model.tiny.dflash import ensure_dflash
from pipeserve.model.tiny.eagle3 import ensure_eagle3
from pipeserve.bench import plots as bench_plots, vision as bench_vision
from pipeserve.bench import ttft


def _generated_head(cfg: Any, model_dir: Path) -> list[str]:
    """draft=eagle3 / dflash / assistant on a generated model with draft.path unset: the
    generated drafter serve.py writes beside it (the bench serves the model by its path,
    where serve.py asks for draft.path instead)."""
    if cfg.draft.path is not None or cfg.model.path is not None or \
            cfg.model.source is not ModelSource.generated:
        return []
    ensure = {"eagle3": ensure_eagle3, "dflash": ensure_dflash,
              "assistant": ensure_assistant}.get(cfg.draft.name)
    return [f"draft.path={ensure(model_dir)}"] if ensure else []


def quantized(model_dir: Path, bits: int) -> Path:
    """`model_dir` quantized to `bits` by mlx-lm's own converter, made once beside it (written
    to a temporary name first, so an interrupted conversion is never taken for a model)."""
    target = model_dir.with_name(f"{model_dir.name}-q{bits}")
    if (target / "config.json").exists():
        return target
    from mlx_lm import convert
    tmp = model_dir.with_name(f".{target.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(str(model_dir), mlx_path=str(tmp), quantize=True, q_bits=bits)
    release_mlx_buffers()   # the conversion's weights: the servers measured next need the device
    tmp.rename(target)
    return target


def run_bench(raw: DictConfig) -> list[Row]:
    cfg = load_config(raw)            # same checks as serve.py, before anything starts
    b = cfg.bench
    from pipeserve.model.loader import resolve_path
    model_dir = resolve_path(cfg.model)
    if b.quantize_bits is not None:
        model_dir = quantized(model_dir, b.quantize_bits)
    out = Path(b.out) if Path(b.out).is_absolute() else ROOT / b.out
    out.mkdir(parents=True, exist_ok=True)
    _new_tables(out)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("bench.")]
    eos = _eos_ids(model_dir)
    eos_bias = {str(i): -100.0 for i in eos}
    rows: list[Row] = []

    if b.workload == "steps":
        return _step_probe(b, cfg, model_dir, out)
    if b.workload == "vision":   # image requests, beside mlx-vlm's generate (pipeserve/bench/vision.py)
        rows = bench_vision.run(b, cfg.model.name, overrides, model_dir, out, eos)
        _write(out, rows)
        return rows
    if b.workload == "ttft":
        vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", 500)
        return ttft.run(b, cfg.model.name, vocab, cfg.scheduler.prefill_chunk, overrides,
                        model_dir, out, eos_bias, write=lambda done: _write(out, done),
                        budget=cfg.scheduler.max_num_batched_tokens)
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
             *_generated_head(cfg, model_dir),
             f"model.name={cfg.model.name}",   # the id the bench asks for, not the dir's name
             f"server.port={port}", "server.host=127.0.0.1", f"hydra.run.dir={out / 'serve-run'}"]
    for core in b.cores:   # one target per engine core placement (bench.cores)
        target = _core_target(core)
        rows.append(_pipeserve(cfg, [*serve, *CORES[core]], out, port, target, overrides,
                               eos_bias, adapters))
        _write(out, rows[-1:])

    if b.engine_alone:
        prompt_tokens = rows[-1].prompt_tokens if rows else float("nan")
        rows.append(_engine_alone(b, overrides, model_dir, prompt_tokens, out))
        _write(out, rows[-1:])
        first = _log_name(_core_target(b.cores[0]))
        spread = (arrival_spread(out / first, b.streams)
                  if b.engine_alone_spread and b.streams > 1 else None)
        if b.engine_alone_spread:
            print(f"bench: the engine alone with HTTP's arrivals: {b.streams} streams over "
                  + (f"{spread:.3f} s ({first})" if spread else
                     "no time: one stream, a burst that arrived within a millisecond, or no "
                     "timed burst in the log (the engine alone's row stands for it)"), flush=True)
        if spread:
            rows.append(_engine_alone(b, overrides, model_dir, prompt_tokens, out, spread))
            _write(out, rows[-1:])

    if b.mlx_lm:
        port = _free_port()
        peer = Process([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                        "--host", "127.0.0.1", "--port", str(port), "--temp", "0",
                        "--max-tokens", str(b.max_tokens)], out / "mlx_lm_server.log",
                       append=sweep_continues())
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


def _core_target(core: str) -> str:
    """A pipeserve target's row name for an engine core placement (bench.cores)."""
    return "pipeserve" if core == "thread" else f"pipeserve, core {core}"


def _log_name(target: str) -> str:
    """The server log's file name of a pipeserve target: pipeserve.log, pipeserve-core-process.log."""
    return f"{target.replace(', ', '-').replace(' ', '-')}.log"


def _pipeserve(cfg: Any, serve: list[str], out: Path, port: int, target: str,
               overrides: list[str], eos_bias: dict[str, float],
               adapters: list[str] | None) -> Row:
    """pipeserve launched as `serve`, driven with the bench's load: its row."""
    b = cfg.bench
    launch, env, others = _ranks(cfg, b, serve, out)   # distributed≠none: b.ranks on 127.0.0.1
    ours = Process([*launch, *serve], out / _log_name(target), group=bool(launch), env=env,
                   append=sweep_continues())   # a sweep's jobs, one after another in one log
    try:
        ours.wait_http(f"http://127.0.0.1:{port}/health")
        m = asyncio.run(drive(f"http://127.0.0.1:{port}", cfg.model.name, b, eos_bias, adapters,
                              cpu=lambda: thread_cpu(ours.proc.pid)))
        print(f"bench: {target}, CPU over the timed part, share of its wall: "
              + ", ".join(f"{k} {v:.3f}" for k, v in m["cpu"].items())
              + f"; the client sent its requests over {m['send_spread_s']:.3f} s; the host: "
              + f"{m['host_steal']:.3f} CPUs stolen, probe {m['host_probe_ms']:.1f} ms",
              flush=True)
        kv = _gauge(f"http://127.0.0.1:{port}", "pipeserve_kv_bytes_per_token")
        added = [o for o in serve if o == "server.isolate=true" and o not in overrides]
        pids = _with_children(ours.proc.pid) if added else [ours.proc.pid]
        rss = sum(_peak_rss_mb(pid) for pid in pids)
        row = _row(target, b, m, rss, " ".join([*overrides, *added]), kv)
        _plot_run(out, target, m, row)
        (out / "prompt-lengths.json").write_text(json.dumps(m["lengths"]))   # engine alone's
        return row
    finally:
        ours.stop()
        for rank in others:   # they leave with rank 0; stop() waits for that
            rank.stop()


def _cache_ttft(b: BenchConfig, model: str, overrides: list[str], model_dir: Path, out: Path,
                eos_bias: dict[str, float]) -> list[Row]:
    """TTFT of one long prompt: cold, then a RAM hit, then (after flush, SIGTERM and a fresh
    start on the same cache.ssd.dir) an SSD hit. Needs cache=ssd among the overrides."""
    if "cache=ssd" not in overrides:
        raise SystemExit("bench.workload=cache_ttft needs cache=ssd (and cache.ssd.dir=...)")
    prompt = _words(b.prompt_words, 0)
    rows = []
    server: Process | None = None
    try:
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
                asyncio.run(_single(base, model, "warm-up " + _words(b.prompt_words, 5), 4,
                                    eos_bias))
            r = asyncio.run(_single(base, model, prompt, b.max_tokens, eos_bias))
            ttft = r["stamps"][0] - r["t0"]
            rows.append(Row(f"pipeserve, {phase}", "cache_ttft", 1, 1, r["tokens"],
                            round(r["end"] - r["t0"], 3), float("nan"), float("nan"),
                            round(ttft, 3), round(ttft, 3), float("nan"), float("nan"),
                            round(_peak_rss_mb(server.proc.pid), 1), " ".join(overrides)))
            if phase != "cold":
                _get(base + "/admin/cache/flush", 600, data=b"")
                server.stop()
    except BaseException:   # a failed phase leaves no server running
        if server is not None:
            server.stop()
        raise
    return rows


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
    del model, lora
    release_mlx_buffers()   # the model loaded for the adapters' shapes
    return ids


register_configs()


ConfigStore.instance().store(name="bench_schema", node=BenchRootConfig)


@hydra.main(config_path=str(ROOT / "pipeserve" / "conf"), config_name="bench", version_base="1.3")
def main(raw: DictConfig) -> None:
    run_bench(raw)


if __name__ == "__main__":
    main()
