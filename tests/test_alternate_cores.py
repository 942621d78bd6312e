"""scripts/alternate_cores.py serves both engine core placements at once and measures them in
alternation: every burst gets its streamed tokens back from each, and the summary has one
median (with its min and max) per placement and stream count, and their ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_both_placements_are_measured_in_alternation(tmp_path: Path, model_cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "alternate_cores.py"), "--streams", "1,3",
         "--reps", "2", "--max-tokens", "8", "--run-dir", str(tmp_path), "--",
         "model=tiny", f"model.cache_dir={model_cache}", "draft.gate=false"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    bursts = [x for x in lines if "rep" in x]
    assert len(bursts) == 2 * 2 * 2   # reps x stream counts x placements
    assert all(x["agg_tok_s"] > 0 and x["ttft_p50_s"] > 0 for x in bursts), bursts
    # the placement that goes first alternates by rep
    assert [x["placement"] for x in bursts if x["streams"] == 1] == [
        "thread", "process", "process", "thread"]
    summary = {(x["placement"], x["streams"]): x for x in lines if x.get("what") == "summary"}
    assert set(summary) == {(p, n) for p in ("thread", "process") for n in (1, 3)}
    for x in summary.values():
        assert x["reps"] == 2
        assert x["agg_tok_s_min"] <= x["agg_tok_s_median"] <= x["agg_tok_s_max"]
    ratios = [x for x in lines if x.get("what") == "process / thread"]
    assert [x["streams"] for x in ratios] == [1, 3]
    for x in ratios:
        n = x["streams"]
        assert abs(x["agg_tok_s_medians"] - summary[("process", n)]["agg_tok_s_median"]
                   / summary[("thread", n)]["agg_tok_s_median"]) < 0.01
