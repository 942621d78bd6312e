"""bench.workload=ttft: every scenario it promises is a row of its table, pipeserve's beside the
library's (a real server on the tiny model, mlx-lm on the same weights), for each engine core
placement bench.cores names."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_ttft_workload_rows_each_scenario_beside_the_library(
        tmp_path: Path, model_cache: Path) -> None:
    res = subprocess.run(
        [sys.executable, "bench.py", "bench.workload=ttft", "model=tiny",
         "bench.ttft_cold=[96,96,48]", "bench.ttft_bursts=[3]", "bench.ttft_first_burst=2",
         "bench.ttft_prefix=8", "bench.ttft_shared_head=40", "bench.cores=[thread,process]",
         f"bench.out={tmp_path}", f"model.cache_dir={model_cache}",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    got = {(r["target"], r["workload"], r["streams"]) for r in rows}
    assert got == {
        *{(target, what, n) for target in ("pipeserve", "pipeserve, core process")
          for what, n in [("ttft:first burst after launch", "2"),
                          ("ttft:the same burst again", "2"),
                          *[(f"ttft:cold prompt {i}", "1") for i in (1, 2, 3)],
                          ("ttft:exact repeat", "1"), ("ttft:new turn on a cached prefix", "1"),
                          ("ttft:burst", "3"), ("ttft:burst + logit_bias", "3"),
                          ("ttft:burst, shared 40-token head", "3")]},
        *{("mlx-lm generate_step", f"ttft:cold prompt {i}", "1") for i in (1, 2, 3)},
        ("mlx-lm BatchGenerator", "ttft:burst", "3"),
        ("mlx-lm BatchGenerator", "ttft:burst, shared 40-token head", "3")}, got
    for r in rows:
        assert math.isfinite(float(r["ttft_p50_s"])) and float(r["ttft_p50_s"]) > 0, r
    # the servers' rows count the tokens their responses reported: at most 4 a request, and
    # some (the tiny model may end a request early at its end-of-text token)
    for r in rows:
        if r["target"].startswith("pipeserve"):
            assert 0 < int(r["output_tokens"]) <= 4 * int(r["requests"]), r
        if r["workload"] == "ttft:burst + logit_bias":   # its end-of-text token suppressed
            assert int(r["output_tokens"]) == 4 * int(r["requests"]), r
    # a burst's row also has its wall time, first request sent to last finished
    bursts = [r for r in rows if r["workload"] in ("ttft:burst", "ttft:burst + logit_bias")
              and r["target"].startswith("pipeserve")]
    assert len(bursts) == 4 and all(float(r["wall_s"]) >= float(r["ttft_p95_s"]) for r in bursts)
    cold = [r for r in rows if r["workload"].startswith("ttft:cold")]
    assert sorted({r["prompt_tokens"] for r in cold}) == ["48", "96"]
    # the repeat is the last 96-token prompt; the new turn adds 64 tokens to it
    assert {r["workload"]: r["prompt_tokens"] for r in rows if r["target"] == "pipeserve"
            and r["workload"] in ("ttft:exact repeat", "ttft:new turn on a cached prefix")} == {
        "ttft:exact repeat": "96", "ttft:new turn on a cached prefix": "160"}
    # the server's request log: the first burst twice, the warm-up prompt, then each burst
    # size's shapes twice on new prompts (the second pass on the connections the first opened,
    # none a cache hit), then the timed scenarios: 4 + 1 + 6 + 3 + 2 + 6 + 4 requests
    done = [line for line in (tmp_path / "pipeserve.log").read_text().splitlines()
            if " - request " in line and "ttft_s=" in line]
    assert len(done) == 26, done
    shapes = done[5:11]
    assert all("prompt_tokens=76 " in x and "cached_tokens=0 " in x for x in shapes), shapes
    # the process core's server ran with its engine in a child process (its own log)
    assert "server.isolate=true" in {r["overrides"] for r in rows
                                     if r["target"] == "pipeserve, core process"}.pop()
    assert (tmp_path / "core-process" / "pipeserve.log").exists()
    # each server's memory and stage seconds after each scenario, for where a slow one went
    for log in (tmp_path / "memory.jsonl", tmp_path / "core-process" / "memory.jsonl"):
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [x["scenario"] for x in lines][-2:] == ["burst + logit_bias 3",
                                                        "ttft:burst, shared 40-token head 3"]
        assert len(lines) == 10, lines
        peaks = [x["mlx_memory_gb.peak"] for x in lines]
        assert peaks == sorted(peaks) and peaks[-1] > 0, peaks   # the peak so far
        assert lines[-1]["stage_seconds_sum.prefill"] > lines[0]["stage_seconds_sum.prefill"]
        # the bench's own process holds no MLX memory beside the servers it measures
        assert all(x["bench_mlx_gb"] == 0.0 for x in lines), [x["bench_mlx_gb"] for x in lines]
        # when the client had written each scenario's requests, after its first one started
        assert all(0 <= x["client_sent_ms_p50"] <= x["client_sent_ms_last"] for x in lines), lines
        # and none sent again: the server reset or refused no kept-alive connection
        assert all(x["client_retries"] == 0 for x in lines), lines
        # the server's own first-token time of the same requests (its request log), which the
        # client's contains: a client that held requests back shows as the difference
        core = "pipeserve, core process" if log.parent.name == "core-process" else "pipeserve"
        client = {r["workload"]: float(r["ttft_p50_s"]) for r in rows if r["target"] == core}
        for x in lines:
            if x["scenario"] in ("burst 3", "burst + logit_bias 3"):
                assert x["server_ttft_found"] == 3, x
                label = "ttft:" + x["scenario"].removesuffix(" 3")
                assert 0 < x["server_ttft_p50_s"] <= client[label], (x, client)
            assert x["server_ttft_found"] >= 1, x
            assert x["client_gc_ms"] >= 0, x   # the client's collector pauses in the scenario


def test_a_ttft_run_cut_short_keeps_the_rows_it_measured(tmp_path: Path, model_cache: Path) -> None:
    """The library's step runs past bench.timeout_s: the run fails, and the server's rows,
    measured before it, are in results.csv (a device call's time limit ended two runs before
    they wrote anything)."""
    res = subprocess.run(
        [sys.executable, "bench.py", "bench.workload=ttft", "model=tiny",
         "bench.ttft_cold=[48]", "bench.ttft_bursts=[2]", "bench.timeout_s=0.01",
         f"bench.out={tmp_path}", f"model.cache_dir={model_cache}",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode != 0
    assert "TimeoutExpired" in res.stderr + res.stdout
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {(r["target"], r["workload"]) for r in rows} == {
        ("pipeserve", "ttft:cold prompt 1"), ("pipeserve", "ttft:exact repeat"),
        ("pipeserve", "ttft:new turn on a cached prefix"), ("pipeserve", "ttft:burst"),
        ("pipeserve", "ttft:burst + logit_bias")}


def test_a_refused_burst_fails_the_run_and_leaves_no_server_running(
        tmp_path: Path, model_cache: Path) -> None:
    """A server that refuses a burst (429: one row, one queued) ends the run with its error,
    and the server the run started is stopped, not left holding the port and the device (the
    client's loop re-raised the error as the run closed it, before the server's stop)."""
    res = subprocess.run(
        [sys.executable, "bench.py", "bench.workload=ttft", "model=tiny",
         "bench.ttft_cold=[]", "bench.ttft_bursts=[6]", "bench.bare_loop=false",
         "scheduler.max_batch=1", "admission.max_queue=1",
         f"bench.out={tmp_path}", f"model.cache_dir={model_cache}",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode != 0
    assert "answered 429" in res.stderr + res.stdout, res.stderr[-2000:]
    left = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and b"serve.py" in cmdline and str(tmp_path).encode() in cmdline:
            left.append(int(proc.name))
    for pid in left:   # the run's own servers: stopped here so a failure leaves none behind
        os.kill(pid, signal.SIGKILL)
    assert not left, f"servers still running: {left}"


def test_a_slow_scenario_leaves_the_stacks_of_the_server_in_its_log(tmp_path: Path) -> None:
    """A scenario still running after `after_s`: the server (here a process that registers
    the server's kill -USR1 dump and sleeps) writes its threads' stacks to its log, `most`
    times at most; a quick one leaves none."""
    import time

    from pipeserve.bench.ttft import _stacks_if_slow
    log = tmp_path / "pipeserve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from pipeserve.launch.stacks import dump_stacks_on_sigusr1;"
             "import sys, time; dump_stacks_on_sigusr1(); print('up', flush=True);"
             "time.sleep(60)"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "up" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        with _stacks_if_slow(proc.pid, log, after_s=5.0):
            pass   # a quick scenario
        assert "most recent call first" not in log.read_text()
        with _stacks_if_slow(proc.pid, log, after_s=0.05, every_s=0.1, most=2):
            time.sleep(1.0)   # a slow one
        deadline = time.monotonic() + 30
        while log.read_text().count("most recent call first") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert text.count("most recent call first") == 2 and "in <module>" in text
        assert proc.poll() is None   # it went on
    finally:
        proc.kill()
        proc.wait(10)
