"""scripts/free_cost.py measures what MLX's allocator costs the calling thread, by buffer size:
frees with MLX's buffer cache full and with room in it, allocations of new and of cached sizes,
a free while the device is busy, and a whole clear_cache; then host-made arrays (allocated,
freed with the cache full, idle and busy) and device arrays read back, and, where CUDA's
memory pool exists, allocations right after a sync: every case is printed with its figures,
and the cache is really at its cap for the "cache full" ones."""
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
    fills = [x for x in lines[1:] if x["case"].startswith("fill")]
    assert fills and all(x["buffers"] >= 1 and x["ms_per_buffer"] > 0 for x in fills)
    cases = [(x["case"], x.get("size_kb")) for x in lines[1:] if not x["case"].startswith("fill")]
    assert cases == [(c, kb) for kb in (160, 4096, 33 * 1024, 256 * 1024)
                     for c in ("alloc new sizes, cache full", "free, cache full",
                               "free, cache room", "alloc cached sizes")] + [
        ("free, cache full, device busy", 33 * 1024), ("clear_cache", None)] + [
        (c, kb) for kb in (0.5, 160.0)
        for c in ("host arrays: alloc new sizes", "host arrays: free, cache full",
                  "host arrays: free, cache full, device busy",
                  "device arrays: first read back")] + [("alloc after a sync", None)]
    full = [x for x in lines[1:] if x["case"] == "free, cache full"]
    # at its cap: no freed buffer fits in it
    assert all(x["cache_bytes"] + x["size_kb"] * 1024 > 100_000_000 for x in full), full
    assert all(x["ms"] >= 0 for x in lines[1:] if "ms" in x)
    host_full = [x for x in lines[1:] if x["case"] == "host arrays: free, cache full"]
    assert [x["bytes_each"] for x in host_full] == [512, 160 * 1024]
    # within 1% of its cap once they are dropped: nearly all of them were freed past it
    assert all(x["cache_bytes"] > 0.99 * 100_000_000 for x in host_full), host_full
    busy = [x for x in lines[1:] if x["case"].endswith("device busy")]
    assert all(x["rest_of_work_ms"] > 0 for x in busy), busy
    # no CUDA pool on this machine: said, not silently left out
    assert lines[-1] == {"case": "alloc after a sync", "skipped": "no CUDA device pool"}
