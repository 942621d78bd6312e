"""bench.py writes PNG plots from its own numbers: a -m sweep draws sweep.png from the sweep's
rows, a single run draws latency.png from its requests (real servers on the tiny model)."""
from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve.bench import plots as bench_plots
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["model=tiny", "bench.max_tokens=6", "bench.prompt_words=8", "bench.warmup=false",
         "bench.bare_loop=false"]


def test_without_the_bench_extra_bench_says_which_extra_to_install() -> None:
    blocked = ("import runpy, sys; sys.modules['aiohttp'] = None; sys.argv = ['bench.py']; "
               "runpy.run_path('bench.py', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "pip install -e '.[bench]'" in res.stderr


def test_a_sweep_with_mlx_lm_server_draws_both_servers() -> None:
    base = {"workload": "concurrent", "ttft_p50_s": "0.1", "ttft_p95_s": "0.2"}
    table = [{**base, "target": t, "overrides": f"bench.streams={n}", "agg_tok_s": str(v)}
             for t, n, v in (("pipeserve", 1, 10), ("mlx_lm.server", 1, 8),
                             ("pipeserve", 4, 30), ("mlx_lm.server", 4, 12))]
    x_key, order, lines = bench_plots.sweep_series(table)
    assert x_key == "bench.streams" and order == ["1", "4"]
    assert lines["pipeserve"]["agg_tok_s"] == [10, 30]
    assert lines["mlx_lm.server"]["agg_tok_s"] == [8, 12]


def test_one_request_is_a_point_on_a_readable_axis() -> None:
    low, high = bench_plots.latency_xlim([0.0001])
    assert low <= 0 and high >= 1.0
    assert bench_plots.latency_xlim([0.0, 12.0])[1] >= 12.0


def run_bench(out: Path, model_cache: Path, *args: str, quick: list[str] = QUICK) -> str:
    res = subprocess.run([sys.executable, "bench.py", *args, *quick, f"bench.out={out}",
                          f"model.cache_dir={model_cache}", f"hydra.sweep.dir={out}/sweep",
                          f"hydra.run.dir={out}/run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    return img.shape[1], img.shape[0]


def rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_sweep_writes_a_plot_of_its_own_numbers(tmp_path: Path, model_cache: Path) -> None:
    out = run_bench(tmp_path, model_cache, "-m", "bench.streams=1,2", "scheduler.max_batch=2,4")
    assert "plot None" not in out   # the first job has no sweep to draw yet, and says nothing
    png = tmp_path / "sweep.png"
    w, h = png_size(png)
    assert w > 600 and h > 300
    table = rows(tmp_path / "sweep.csv")
    assert len(table) == 4
    x_key, order, lines = bench_plots.sweep_series(table)
    assert x_key in ("bench.streams", "scheduler.max_batch") and len(order) == 2
    assert len(lines) == 2
    # every drawn point is a number from the run's own table, and every row is drawn
    drawn = sorted(v for line in lines.values() for v in line["agg_tok_s"])
    assert drawn == sorted(float(r["agg_tok_s"]) for r in table)
    assert all(v > 0 and not math.isnan(v) for v in drawn)
    # the sweep's rows are also in the cumulative table
    assert {r["agg_tok_s"] for r in table} <= {r["agg_tok_s"] for r in rows(tmp_path / "results.csv")}
    # each job's server appends to one log, so every job's burst is on record (a later job's
    # server once replaced the earlier ones' lines)
    log = (tmp_path / "pipeserve.log").read_text()
    assert log.count("- request ") == sum(int(r["streams"]) for r in table), \
        "a job's request lines are missing"   # bench.warmup=false: the timed requests alone


@pytest.mark.slow
def test_single_run_writes_a_per_request_latency_plot(tmp_path: Path, model_cache: Path) -> None:
    (tmp_path / "results.csv").write_text("target,workload\nan earlier run,single\n")
    port = free_port()
    out = run_bench(tmp_path, model_cache, "bench.streams=3", "bench.batch_generator=true",
                    f"server.port={port}")
    assert f"listening on 127.0.0.1:{port}" in (tmp_path / "pipeserve.log").read_text()
    # a run's table is its own (it appended to the last run's before)
    assert "an earlier run" not in (tmp_path / "results.csv").read_text()
    assert "latency.png" in out
    png_size(tmp_path / "latency.png")
    reqs = rows(tmp_path / "requests.csv")
    assert len(reqs) == 3 and {r["target"] for r in reqs} == {"pipeserve"}
    table = rows(tmp_path / "results.csv")
    summary = table[0]
    # the library's own batched loop ran the same prompts to the same length
    library = [r for r in table if r["target"] == "mlx-lm BatchGenerator"]
    assert len(library) == 1 and int(library[0]["output_tokens"]) == 3 * 6
    ttfts = sorted(float(r["ttft_s"]) for r in reqs)
    assert float(summary["ttft_p50_s"]) == pytest.approx(ttfts[1], abs=1e-3)
    assert all(float(r["latency_s"]) >= float(r["ttft_s"]) > 0 for r in reqs)


@pytest.mark.slow
def test_a_burst_of_streams_is_served_and_counted_whole(tmp_path: Path, model_cache: Path) -> None:
    """48 streams × 2 requests through the bench's client (a connection per stream, kept
    alive between a stream's requests): every request is counted, at its full length."""
    run_bench(tmp_path, model_cache, "bench.streams=48", "bench.requests_per_stream=2",
              "scheduler.max_batch=48", "admission.max_queue=128", "model.size=tiny",
              "model.dtype=float32")
    summary = rows(tmp_path / "results.csv")[0]
    assert summary["target"] == "pipeserve" and int(summary["requests"]) == 96
    assert int(summary["errors"]) == 0 and int(summary["output_tokens"]) == 96 * 6
    reqs = rows(tmp_path / "requests.csv")
    assert len(reqs) == 96 and all(int(r["tokens"]) == 6 for r in reqs)
    assert all(float(r["latency_s"]) >= float(r["ttft_s"]) > 0 for r in reqs)


@pytest.mark.slow
def test_one_call_times_the_thread_core_and_the_process_core(tmp_path: Path,
                                                             model_cache: Path) -> None:
    """bench.cores=[thread,process]: one row per engine core placement, the same load, every
    request counted at its full length; the process core's row names its launch override."""
    out = run_bench(tmp_path, model_cache, "bench.streams=3", "bench.cores=[thread,process]")
    table = {r["target"]: r for r in rows(tmp_path / "results.csv")}
    assert list(table) == ["pipeserve", "pipeserve, core process"]
    for row in table.values():
        assert int(row["requests"]) == 3 and int(row["errors"]) == 0
        assert int(row["output_tokens"]) == 3 * 6
    assert "server.isolate=true" in table["pipeserve, core process"]["overrides"]
    assert "server.isolate" not in table["pipeserve"]["overrides"]
    log = (tmp_path / "pipeserve-core-process.log").read_text()
    assert "engine process" in log and "ready: pool of tiny" in log
    # each says where its CPU went over the timed part: the thread core's engine runs on a
    # thread of the API process, the process core's in a process of its own
    cpu = {t: dict(re.findall(r"(api loop|api threads|core process|client loop) ([\d.]+)", line))
           for t, line in re.findall(r"bench: (pipeserve(?:, core process)?), CPU over the "
                                     r"timed part, share of its wall: (.*)", out)}
    assert set(cpu) == {"pipeserve", "pipeserve, core process"}, out[-2000:]
    assert all(len(shares) == 4 for shares in cpu.values()), cpu
    spreads = [float(x) for x in re.findall(r"the client sent its requests over ([\d.]+) s", out)]
    assert len(spreads) == 2 and all(x >= 0 for x in spreads), out[-2000:]
    thread, process = ({k: float(v) for k, v in cpu[t].items()} for t in table)
    assert thread["api threads"] > thread["core process"], cpu
    assert process["core process"] > process["api threads"], cpu


@pytest.mark.slow
def test_the_engine_alone_again_with_the_http_bursts_arrivals(tmp_path: Path,
                                                               model_cache: Path) -> None:
    """bench.engine_alone_spread=true: after the engine-alone row, one more whose streams
    arrive over as long as the server's log says the timed HTTP burst took to arrive. Every
    row says what the host was doing while it was timed."""
    out = run_bench(tmp_path, model_cache, "bench.streams=8", "bench.engine_alone=true",
                    "bench.engine_alone_spread=true")
    table = {r["target"]: r for r in rows(tmp_path / "results.csv")}
    assert list(table) == ["pipeserve", "pipeserve engine alone",
                           "pipeserve engine alone, HTTP's arrivals"], out[-2000:]
    for row in table.values():
        assert int(row["requests"]) == 8 and int(row["output_tokens"]) == 8 * 6
        # the host each was timed on: CPUs the hypervisor took meanwhile, one core's speed
        assert 0 <= float(row["host_steal"]) < 64 and float(row["host_probe_ms"]) > 0, row
    assert re.search(r"the host: [\d.]+ CPUs stolen, probe [\d.]+ ms", out), out[-2000:]
    said = re.search(r"the engine alone with HTTP's arrivals: 8 streams over ([\d.]+) s "
                     r"\(pipeserve.log\)", out)
    assert said is not None, out[-2000:]
    res = subprocess.run([sys.executable, "scripts/request_log_bursts.py",
                          str(tmp_path / "pipeserve.log")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    import json
    timed = [b for b in map(json.loads, res.stdout.splitlines()) if b["requests"] == 8][-1]
    assert float(said.group(1)) == pytest.approx(timed["arrival_spread_s"])
    assert timed["arrival_spread_s"] > 0   # eight handlers start one after another
    assert (tmp_path / "engine-alone-8-spread.log").is_file()


def test_bench_cores_names_what_it_takes() -> None:
    from pipeserve.bench.config import BenchConfig
    from pipeserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"bench.cores must list one or more of thread, process; "
                                          r"got \['gpu'\]"):
        BenchConfig(cores=["gpu"])


def test_quantize_bits_serves_every_target_the_4_bit_copy(tmp_path: Path,
                                                          model_cache: Path) -> None:
    """bench.quantize_bits=4: the model is converted once by mlx-lm (a sibling directory whose
    config says 4 bits) and pipeserve serves that copy; a bad width is one line naming it."""
    run_bench(tmp_path, model_cache, "bench.streams=2", "bench.quantize_bits=4")
    copies = list(model_cache.glob("*-q4"))
    assert len(copies) == 1, copies
    import json
    assert json.loads((copies[0] / "config.json").read_text())["quantization"]["bits"] == 4
    row = rows(tmp_path / "results.csv")[0]
    assert int(row["requests"]) == 2 and int(row["errors"]) == 0
    assert f"ready: model tiny from {copies[0].name} " in (tmp_path / "pipeserve.log").read_text()
    res = subprocess.run([sys.executable, "bench.py", *QUICK, "bench.quantize_bits=7",
                          f"hydra.run.dir={tmp_path}/bad"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and "bench.quantize_bits must be one of" in res.stderr + res.stdout



@pytest.mark.slow
def test_the_batch_generator_takes_prompts_longer_than_one_argument_holds(
        tmp_path: Path, model_cache: Path) -> None:
    """48 prompts of 500 control characters are 144 KB of JSON, more than Linux lets one
    argument hold (128 KiB); a 128-stream burst of 620-token prompts is 144 KB. The
    BatchGenerator reads its prompts from stdin, so such a burst gets its library row (the
    bench failed with E2BIG before). Each character is one token of the generated models'
    tokenizer and six bytes of JSON, so the model reads few tokens."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("\x01" * 500)
    run_bench(tmp_path, model_cache, "bench.streams=48", f"bench.prompt_file={prompt}",
              "bench.max_tokens=2", "bench.batch_generator=true", "scheduler.max_batch=48",
              "admission.max_queue=64", quick=["model=tiny", "model.size=tiny",
                                               "model.dtype=float32", "bench.warmup=false",
                                               "bench.bare_loop=false"])
    table = {r["target"]: r for r in rows(tmp_path / "results.csv")}
    library = table["mlx-lm BatchGenerator"]
    assert int(library["requests"]) == 48 and int(library["output_tokens"]) == 48 * 2
    assert float(library["prompt_tokens"]) == float(table["pipeserve"]["prompt_tokens"]) == 500


def test_a_burst_of_128_long_prompts_are_128_prompts_sharing_no_prefix() -> None:
    """bench's prompts are each request's own: a 128-stream burst of 620-token prompts had
    26 distinct ones, so on a server with a prompt cache 102 of them were cache hits (round
    32's H100 burst read 609-618 cached tokens of 610-621), against an engine alone computing
    every one. Now no two share more than their first word, each as many words as asked."""
    from pipeserve.bench.config import BenchConfig
    from pipeserve.bench.workload import _prompts

    for workload in ("single", "concurrent", "distinct"):
        prompts = _prompts(BenchConfig(streams=128, prompt_words=205, workload=workload))
        assert len(set(prompts)) == 128, workload
        seen: dict[tuple[str, str], int] = {}
        for i, p in enumerate(prompts):   # the first two words of no two prompts agree
            key = tuple(p.split()[:2])
            assert key not in seen, (workload, i, seen.get(key), key)
            seen[key] = i
    lengths = {len(p.split()) for p in _prompts(BenchConfig(streams=128, prompt_words=205))}
    assert lengths == {205}
