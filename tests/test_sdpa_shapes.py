"""scripts/sdpa_shapes.py: one line per shape and mask kind, in the order given, each with the
first call's and the repeat's time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_shape_is_timed_first_and_again_under_both_masks() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sdpa_shapes.py"),
                          "--shapes", "2x8,1x5", "--heads", "4", "--kv-heads", "2", "--dim", "64"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["mask"], r["B"], r["L"]) for r in lines] == [
        ("array", 2, 8), ("array", 1, 5), ("causal", 2, 8), ("causal", 1, 5)]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in lines), lines
