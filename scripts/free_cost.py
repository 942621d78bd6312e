"""What MLX's allocator costs the thread that frees or allocates, by buffer size: freeing with
MLX's cache of freed buffers full (what a busy server's is; freed memory then goes back to the
device) and with room in it (the buffer is only recycled); allocating sizes no cached buffer
fits (a new device allocation) and sizes the cache holds (reuse); a free while the device
still runs queued work; and `mx.clear_cache()` with the cache at its cap. One JSON line per
case; the fill of the cache is itself timed (new allocations of distinct sizes).

    python scripts/free_cost.py                 # the device's defaults (pipeserve's CUDA cap)
    python scripts/free_cost.py --total-mb 64 --cache-cap-gb 0.2   # a small run (the CPU)

Measured on the H200 (2026-12-05, docs/notes/2026-12-05-round7.md): a free costs the dropping
thread 1-3 us a buffer with the cache full, and clear_cache 7 ms for 6.2 GB; filling 15 GB
with new 8 MB buffers took most of a 100 s call.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx

SIZES_KB = (160, 4096, 33 * 1024, 256 * 1024)   # a short entry's layer .. a long one's
FILL_MB = 64   # the cache is filled with new buffers of at most this size (a 64th of its cap)


def arrays(n: int, size_kb: int, pad: int = 0) -> list[mx.array]:
    """n evaluated arrays of size_kb KiB (plus `pad` bytes each: a size nothing cached fits)."""
    out = [mx.zeros((size_kb * 1024 + pad,), dtype=mx.uint8) for _ in range(n)]
    mx.eval(out)
    return out


def timed_drop(batch: list[mx.array]) -> float:
    """Seconds the dropping thread spends releasing every array of `batch` (the caller's
    list is emptied: nothing else holds them)."""
    t0 = time.perf_counter()
    batch.clear()
    return time.perf_counter() - t0


def fill_cache(target: int, seed: list[int]) -> None:
    """MLX's buffer cache up to `target` bytes with buffers of sizes never asked for before;
    prints how long those new allocations took."""
    t0, made = time.perf_counter(), 0
    size = max(1 << 20, min(FILL_MB << 20, target // 64))
    while mx.get_cache_memory() < 0.95 * target:
        before = mx.get_cache_memory()
        seed[0] += 1
        a = mx.zeros((size + 16384 * seed[0],), dtype=mx.uint8)
        mx.eval(a)
        made += 1
        del a
        if mx.get_cache_memory() <= before:   # the cap keeps it lower
            break
    if made:
        s = time.perf_counter() - t0
        print(json.dumps({"case": "fill (new allocations)", "size_kb": size // 1024,
                          "buffers": made, "ms": round(1000 * s, 1),
                          "ms_per_buffer": round(1000 * s / made, 3),
                          "cache_bytes": mx.get_cache_memory()}), flush=True)


def case(name: str, size_kb: int, n: int, seconds: float, **extra: object) -> None:
    print(json.dumps({"case": name, "size_kb": size_kb, "buffers": n,
                      "ms": round(1000 * seconds, 3),
                      "us_per_buffer": round(1e6 * seconds / n, 1),
                      "ms_per_gb": round(1000 * seconds / (n * size_kb / 2**20), 2), **extra}),
          flush=True)


def timed_alloc(n: int, size_kb: int, pad: int) -> tuple[float, list[mx.array]]:
    t0 = time.perf_counter()
    made = arrays(n, size_kb, pad)
    return time.perf_counter() - t0, made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=int, default=2048, help="bytes freed per case")
    ap.add_argument("--cache-cap-gb", type=float, default=None,
                    help="MLX's buffer cache cap (default: pipeserve's, 10%% of the device on "
                         "CUDA; MLX's own elsewhere)")
    args = ap.parse_args()
    from pipeserve.memory import buffer_cache_limit
    cap = (int(args.cache_cap_gb * 1e9) if args.cache_cap_gb is not None
           else buffer_cache_limit(None))
    if cap is not None:
        mx.set_cache_limit(cap)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "cache_cap_bytes": cap}), flush=True)
    seed = [0]
    for size_kb in SIZES_KB:
        n = max(2, args.total_mb * 1024 // size_kb)
        pad = 4096 * (size_kb % 7 + 1)
        if cap is not None:
            fill_cache(cap, seed)
        # new sizes with the cache full: device allocations (and the cache trimmed to its cap)
        spent, batch = timed_alloc(n, size_kb, pad)
        case("alloc new sizes, cache full", size_kb, n, spent, cache_bytes=mx.get_cache_memory())
        # the cache full: every free goes back to the device
        if cap is not None:
            fill_cache(cap, seed)
        case("free, cache full", size_kb, n, timed_drop(batch), cache_bytes=mx.get_cache_memory())
        # room in the cache (its limit raised past what it holds, nothing cleared, so the
        # next size needs no new fill): the buffers are kept for reuse, then reused
        batch = arrays(n, size_kb, pad)
        mx.set_cache_limit(mx.get_cache_memory() + 2 * n * (size_kb * 1024 + pad))
        case("free, cache room", size_kb, n, timed_drop(batch), cache_bytes=mx.get_cache_memory())
        spent, batch = timed_alloc(n, size_kb, pad)
        case("alloc cached sizes", size_kb, n, spent, cache_bytes=mx.get_cache_memory())
        del batch
        mx.set_cache_limit(cap if cap is not None else mx.get_memory_limit())
        gc.collect()
    # a free while the device still runs queued work: how long the drop waits
    size_kb = 33 * 1024
    n = max(2, args.total_mb * 1024 // size_kb)
    batch = arrays(n, size_kb)
    if cap is not None:
        fill_cache(cap, seed)
    dim = 8192 if mx.default_device().type == mx.DeviceType.gpu else 512
    a = mx.random.normal((dim, dim))
    mx.eval(a)
    work = a
    for _ in range(16):   # a few hundred ms on an H200
        work = work @ a / dim
    t0 = time.perf_counter()
    mx.async_eval(work)
    queued = time.perf_counter() - t0
    dropped = timed_drop(batch)
    t1 = time.perf_counter()
    mx.eval(work)
    case("free, cache full, device busy", size_kb, n, dropped, queued_ms=round(1000 * queued, 2),
         rest_of_work_ms=round(1000 * (time.perf_counter() - t1), 2))
    # the whole cache back to the device at once (what a periodic clear_cache costs)
    if cap is not None:
        fill_cache(cap, seed)
    held = mx.get_cache_memory()
    t0 = time.perf_counter()
    mx.clear_cache()
    print(json.dumps({"case": "clear_cache", "cache_bytes": held,
                      "ms": round(1000 * (time.perf_counter() - t0), 3)}), flush=True)


if __name__ == "__main__":
    main()
