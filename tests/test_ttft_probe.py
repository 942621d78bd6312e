"""scripts/ttft_probe.py --split: the engine alone, a burst's time split into the loop's parts
and, inside persist and the prompt cache, the row copies, the cache's own copies, trie and
their device calls (the tiny model, so the rows share one block)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_bursts_persist_is_split_into_its_parts(model_cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ttft_probe.py"), "--cold", "none", "--burst",
         "8", "--library", "none", "--split", "--", "model=tiny",
         f"model.cache_dir={model_cache}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    bursts = [json.loads(line) for line in out.stdout.splitlines()
              if line.startswith("{") and '"engine burst"' in line]
    assert len(bursts) == 4   # two reps, with and without logit_bias
    parts = set().union(*(b["per_step_ms"] for b in bursts))
    # the burst's finished rows were stored (one block: the cache's device call, its views
    # handed to `own`, the trie) and the loop's parts are there beside them
    assert {"retire (persist finished)", "cache.put", "cache.own", "cache.mx.async_eval",
            "kv.release_many", "launch"} <= parts, parts
    assert all(b["ttft_p50_s"] > 0 and b["tokens"] == 8 * 8 for b in bursts)


def test_a_cold_prompts_timeline_has_each_chunk(model_cache: Path) -> None:
    """--timeline on cold prompts: every engine call of each prompt in order, its prompt chunks
    among them (a 600-token prompt on the CPU's 256-token chunks: three, 599 tokens in all;
    the last token is the first decode's input)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ttft_probe.py"), "--cold", "600", "--burst",
         "none", "--library", "none", "--timeline", "--", "model=tiny",
         "scheduler.prefill_chunk=256", f"model.cache_dir={model_cache}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(json.loads(x) for x in out.stdout.splitlines() if '"timeline"' in x)
    assert line["cold prompt"] == 0 and line["columns"].startswith("part, start ms, ms")
    chunks = [e for e in line["events"] if e[0] == "launch" and e[4] == 1]
    assert [e[5] for e in chunks] == [256, 256, 87]
