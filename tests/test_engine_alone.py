"""scripts/engine_alone.py (bench.engine_alone's row): the engine with no HTTP, on prompts as
long as the server run's, each one, so the two rows meet the same prompt shapes. Real engine,
real model, CPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_prompts_as_long_as_the_server_runs(model_cache: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "engine_alone.py"), "--streams", "2",
         "--max-tokens", "3", "--lengths", "9,14", "--warm-lengths", "5", "--bias", "on",
         "--library", "none", "--reps", "2", "--", "model=tiny", f"model.cache_dir={model_cache}",
         "server.cuda_graphs=false", "scheduler.step_trace=true"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    # the config's setting reached MLX's environment before MLX was imported (it was ignored
    # when the script imported the engine first: every row ran MLX's default)
    assert [r["cuda_graphs"] for r in rows if r.get("what") == "loaded"] == ["0"], out.stdout
    alone = [r for r in rows if r.get("what") == "engine alone"]
    assert len(alone) == 2, out.stdout[-3000:]
    for rep in alone:
        assert rep["prompt_tokens"] == [9, 14]
        assert rep["tokens"] == 6 and rep["streams"] == 2
        # each rep's prompts are new (as a stream's next request through HTTP): no cache hit
        assert rep["cached_tokens"] == 0, rep
        # the loop's own Python a step: its parts less the waits on the device (async_eval
        # runs the step itself on the CPU backend, inside launch), within the step's wall
        ms = rep["per_step_ms"]
        assert ms["dispatch (in launch)"] > 0 and ms["dispatch (late)"] == 0, ms
        assert 0 < ms["host"] <= 1000 * rep["wall_s"] / ms["steps"], rep
    # scheduler.step_trace=true: the engine's step lines on stderr, which
    # request_log_bursts.py --steps-only groups: warm-up and two reps, each of 2 rows
    log = tmp_path / "engine-alone.log"
    log.write_text(out.stderr)
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "request_log_bursts.py"),
                          "--steps-only", "--gap", "60", str(log)],
                         capture_output=True, text=True, check=True).stdout
    [group] = [json.loads(line) for line in got.splitlines()]
    # prompts of 5 (the warm-up), 9 and 14 tokens, 3 tokens out each (the warm-up 16): every
    # batch's prompt step, then decode steps of its rows
    assert group["rows_max"] == 2 and group["prompt_steps"] >= 3, group
    assert group["steps"] > group["prompt_steps"], group
    assert group["decode_parts_ms_p50"]["launch"] > 0, group   # the forward, timed


def test_spread_arrivals_count_ttft_from_each_submit(model_cache: Path) -> None:
    """--spread: the streams arrive over that window (an HTTP burst's), not all at once; each
    one's TTFT counts from its own submit, so the late one's wait is not its TTFT."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "engine_alone.py"), "--streams", "2",
         "--max-tokens", "3", "--spread", "0.6", "--bias", "on", "--library", "none",
         "--", "model=tiny", f"model.cache_dir={model_cache}", "server.cuda_graphs=false"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [rep] = [json.loads(line) for line in out.stdout.splitlines()
             if line.startswith("{") and '"engine alone"' in line]
    assert rep["spread_s"] == 0.6 and rep["tokens"] == 6, rep
    assert rep["wall_s"] >= 0.3, rep   # the second stream was sent 0.3 s after the first
    # its first token came after its own submit, within the run: counted from the run's start
    # it would be at least the 0.3 s it waited to be sent, and within 3 tokens of wall_s
    assert 0 < rep["ttft_last_s"] <= rep["wall_s"] - 0.3 + 1e-3, rep


def test_follow_up_turns_hit_the_prompt_cache(model_cache: Path) -> None:
    """--follow-up: each timed prompt is its own untimed first turn plus new tokens, so the
    timed burst is a group of prompt-cache hits (agents' next turns), not cold prompts."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "engine_alone.py"), "--streams", "2",
         "--max-tokens", "3", "--lengths", "4,7", "--warm-lengths", "12", "--follow-up",
         "--bias", "on", "--library", "none", "--reps", "2", "--", "model=tiny",
         f"model.cache_dir={model_cache}", "server.cuda_graphs=false"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    alone = [json.loads(line) for line in out.stdout.splitlines()
             if line.startswith("{") and '"engine alone"' in line]
    assert len(alone) == 2, out.stdout[-3000:]
    for rep in alone:
        assert rep["prompt_tokens"] == [16, 19] and rep["tokens"] == 6, rep
        # each row reused most of its 12-token first turn (the cache keeps whole blocks or
        # all but the last token); without the first turns nothing would be cached
        assert rep["cached_tokens"] >= 2 * 8, rep
