"""What freeing MLX arrays costs the thread that drops them, by buffer size: with MLX's cache
of freed buffers full (what a busy server's is: freed memory then goes back to the device at
once; on CUDA a synchronous cudaFree of managed memory), with room in it (the buffer is only
recycled), and while a long computation is queued on the device (does a free wait for it?);
then what `mx.clear_cache()` costs with the cache at its cap. One JSON line per case.

    python scripts/free_cost.py                 # the device's defaults (pipeserve's CUDA cap)
    python scripts/free_cost.py --total-mb 64   # a small run (the CPU)
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx

SIZES_KB = (160, 4096, 33 * 1024, 256 * 1024)   # a short entry's layer .. a long one's


def arrays(n: int, size_kb: int) -> list[mx.array]:
    out = [mx.zeros((size_kb * 256,), dtype=mx.float32) for _ in range(n)]
    mx.eval(out)
    return out


def timed_drop(batch: list[mx.array]) -> float:
    """Seconds the dropping thread spends releasing every array of `batch` (the caller's
    list is emptied: nothing else holds them)."""
    t0 = time.perf_counter()
    batch.clear()
    return time.perf_counter() - t0


def fill_cache(target: int) -> None:
    """MLX's buffer cache at `target` bytes: arrays made and dropped while there is room."""
    while mx.get_cache_memory() < target:
        before = mx.get_cache_memory()
        a = arrays(8, 8 * 1024)
        del a
        gc.collect()
        if mx.get_cache_memory() <= before:   # the cap keeps it lower
            return


def case(name: str, size_kb: int, n: int, seconds: float, **extra: object) -> None:
    print(json.dumps({"case": name, "size_kb": size_kb, "buffers": n,
                      "ms": round(1000 * seconds, 3),
                      "us_per_buffer": round(1e6 * seconds / n, 1),
                      "ms_per_gb": round(1000 * seconds / (n * size_kb / 2**20), 2), **extra}),
          flush=True)


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
    for size_kb in SIZES_KB:
        n = max(2, args.total_mb * 1024 // size_kb)
        # the cache full: every free goes back to the device
        batch = arrays(n, size_kb)
        if cap is not None:
            fill_cache(cap)
        case("cache full", size_kb, n, timed_drop(batch), cache_bytes=mx.get_cache_memory())
        # room in the cache: the buffers are kept for reuse
        mx.clear_cache()
        if cap is not None:
            mx.set_cache_limit(max(cap, 2 * n * size_kb * 1024))
        batch = arrays(n, size_kb)
        case("cache room", size_kb, n, timed_drop(batch), cache_bytes=mx.get_cache_memory())
        if cap is not None:
            mx.set_cache_limit(cap)
        mx.clear_cache()
    # a free while the device still runs queued work: how long the drop waits
    size_kb = 33 * 1024
    n = max(2, args.total_mb * 1024 // size_kb)
    batch = arrays(n, size_kb)
    if cap is not None:
        fill_cache(cap)
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
    case("cache full, device busy", size_kb, n, dropped,
         queued_ms=round(1000 * queued, 2), rest_of_work_ms=round(1000 * (time.perf_counter() - t1), 2))
    # the whole cache back to the device at once (what a periodic clear_cache costs)
    if cap is not None:
        fill_cache(cap)
    held = mx.get_cache_memory()
    t0 = time.perf_counter()
    mx.clear_cache()
    print(json.dumps({"case": "clear_cache", "cache_bytes": held,
                      "ms": round(1000 * (time.perf_counter() - t0), 3)}), flush=True)


if __name__ == "__main__":
    main()
