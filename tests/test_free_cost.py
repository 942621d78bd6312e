"""scripts/free_cost.py measures what dropping MLX arrays costs the dropping thread, by buffer
size, with MLX's buffer cache full and with room in it, while the device is busy, and a whole
clear_cache: every case is printed with its figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_case_is_measured() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "free_cost.py"), "--total-mb",
                          "32", "--cache-cap-gb", "0.1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["cache_cap_bytes"] == 100_000_000
    cases = [(x["case"], x.get("size_kb")) for x in lines[1:]]
    assert cases == [(c, kb) for kb in (160, 4096, 33 * 1024, 256 * 1024)
                     for c in ("cache full", "cache room")] + [
        ("cache full, device busy", 33 * 1024), ("clear_cache", None)]
    assert all(x["ms"] >= 0 for x in lines[1:])
    assert all(x["buffers"] >= 2 and x["us_per_buffer"] >= 0 for x in lines[1:-1])
