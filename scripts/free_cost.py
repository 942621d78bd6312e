"""What MLX's allocator costs the thread that frees or allocates, by buffer size: freeing with
MLX's cache of freed buffers full (what a busy server's is; freed memory then goes back to the
device) and with room in it (the buffer is only recycled); allocating sizes no cached buffer
fits (a new device allocation) and sizes the cache holds (reuse); a free while the device
still runs queued work; and `mx.clear_cache()` with the cache at its cap. One JSON line per
case; the fill of the cache is itself timed (new allocations of distinct sizes).

Then the cases MLX's CUDA allocator (0.32) treats apart, read from its source:

- host-made arrays (`mx.array` of host data: token ids, logit_bias indices) live in unified
  memory (`cudaMallocManaged`), and reading a device array back (`tolist`, `item`) moves it
  there first; freeing a unified buffer past the cache's cap is a `cudaFree`, which waits for
  the whole device, with the GIL held by the thread that dropped it;
- a device allocation no cached buffer fits comes from CUDA's default memory pool, which
  gives its unused memory back to the OS at every synchronization unless its release
  threshold says otherwise (MLX leaves it at 0): "alloc after a sync" times new allocations
  right after one, at the pool's threshold as found and (`cuMemPoolSetAttribute` through the
  driver) at its maximum; on a machine without the CUDA driver those lines say so.

    python scripts/free_cost.py                 # the device's defaults (pipeserve's CUDA cap)
    python scripts/free_cost.py --total-mb 64 --cache-cap-gb 0.2   # a small run (the CPU)

Measured on the H200 (2026-12-05, docs/notes/2026-12-05-round7.md): a free costs the dropping
thread 1-3 us a buffer with the cache full, and clear_cache 7 ms for 6.2 GB; filling 15 GB
with new 8 MB buffers took most of a 100 s call.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import time

import mlx.core as mx
import numpy as np

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
    each = extra.get("bytes_each", size_kb * 1024)
    print(json.dumps({"case": name, "size_kb": size_kb, "buffers": n,
                      "ms": round(1000 * seconds, 3),
                      "us_per_buffer": round(1e6 * seconds / n, 1),
                      "ms_per_gb": round(1000 * seconds / (n * each / 2**30), 2), **extra}),
          flush=True)


def timed_alloc(n: int, size_kb: int, pad: int) -> tuple[float, list[mx.array]]:
    t0 = time.perf_counter()
    made = arrays(n, size_kb, pad)
    return time.perf_counter() - t0, made


def host_arrays(n: int, size_b: int, seed: int) -> list[mx.array]:
    """n arrays made from host data, each of a size nothing cached fits (unified memory on CUDA)."""
    return [mx.array(np.full(size_b + 64 * (seed + i % 61), i % 251, dtype=np.uint8))
            for i in range(n)]


def busy_device(dim: int) -> mx.array:
    """A chain of matmuls queued on the device (evaluated once first: no first-call costs)."""
    a = mx.random.normal((dim, dim))
    mx.eval(a)
    work = a
    for _ in range(16):   # a few hundred ms on an H200
        work = work @ a / dim
    mx.eval(work)
    work = a
    for _ in range(16):
        work = work @ a / dim
    return work


def drop_while_busy(batch: list[mx.array], dim: int) -> tuple[float, dict[str, float]]:
    """Seconds dropping `batch` takes while the device runs queued matmuls, and how long
    queueing them and the rest of their work took (ms): a free that waits for the device
    shows as a drop as long as the work."""
    work = busy_device(dim)
    t0 = time.perf_counter()
    mx.async_eval(work)
    queued = time.perf_counter() - t0
    dropped = timed_drop(batch)
    t1 = time.perf_counter()
    mx.eval(work)
    return dropped, {"queued_ms": round(1000 * queued, 2),
                     "rest_of_work_ms": round(1000 * (time.perf_counter() - t1), 2)}


class DevicePool:
    """CUDA's default memory pool of device 0, through the driver API (MLX links the CUDA
    runtime statically; the pool is the driver's, shared by every runtime in the process)."""

    RELEASE_THRESHOLD, RESERVED_MEM_CURRENT, USED_MEM_CURRENT = 4, 5, 7

    def __init__(self) -> None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        self.lib = ctypes.CDLL(name)
        self.pool = ctypes.c_void_p()
        dev = ctypes.c_int()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                           ("cuDeviceGetDefaultMemPool", (ctypes.byref(self.pool), dev))):
            err = getattr(self.lib, call)(*args)
            if err:
                raise OSError(f"{call} failed: CUresult {err}")

    def get(self, attr: int) -> int:
        v = ctypes.c_uint64()
        err = self.lib.cuMemPoolGetAttribute(self.pool, attr, ctypes.byref(v))
        if err:
            raise OSError(f"cuMemPoolGetAttribute({attr}) failed: CUresult {err}")
        return v.value

    def set_threshold(self, n: int) -> None:
        v = ctypes.c_uint64(n)
        err = self.lib.cuMemPoolSetAttribute(self.pool, self.RELEASE_THRESHOLD, ctypes.byref(v))
        if err:
            raise OSError(f"cuMemPoolSetAttribute failed: CUresult {err}")


def device_pool() -> DevicePool | None:
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    try:
        return DevicePool()
    except OSError as e:   # no CUDA driver (a Mac's Metal), or no pool
        print(json.dumps({"case": "device pool", "skipped": str(e)}), flush=True)
        return None


def unified_cases(args: argparse.Namespace, cap: int | None, seed: list[int]) -> None:
    """Host-made arrays and read-backs: what a step's token ids and logit_bias cost."""
    for size_b in (512, 160 * 1024):
        n = max(2, min(4096, args.total_mb * 1024 * 1024 // size_b // 4))
        seed[0] += 1
        if cap is not None:
            fill_cache(cap, seed)
        t0 = time.perf_counter()
        batch = host_arrays(n, size_b, seed[0] * 97)
        mx.eval(batch)
        case("host arrays: alloc new sizes", size_b / 1024, n, time.perf_counter() - t0,
             bytes_each=size_b, cache_bytes=mx.get_cache_memory())
        if cap is not None:
            fill_cache(cap, seed)
        case("host arrays: free, cache full", size_b / 1024, n, timed_drop(batch),
             bytes_each=size_b, cache_bytes=mx.get_cache_memory())
        # the same while the device runs queued work: a free that waits for the device shows
        batch = host_arrays(n, size_b, seed[0] * 97 + 13)
        mx.eval(batch)
        if cap is not None:
            fill_cache(cap, seed)
        dropped, busy = drop_while_busy(batch, args.busy_dim)
        case("host arrays: free, cache full, device busy", size_b / 1024, n, dropped,
             bytes_each=size_b, **busy)
        # device results read back (moved to unified memory on CUDA), as a step's token ids are
        made = [mx.zeros((size_b + 64 * (i % 61),), dtype=mx.uint8) + (i % 251) for i in range(n)]
        mx.eval(made)
        t0 = time.perf_counter()
        for a in made:
            np.asarray(a)
        case("device arrays: first read back", size_b / 1024, n, time.perf_counter() - t0,
             bytes_each=size_b)
        del made
        gc.collect()


def pool_cases(args: argparse.Namespace, pool: DevicePool) -> None:
    """New device allocations right after a synchronization, the pool's threshold as found
    and then at its maximum: what a burst's first step pays after an idle engine synced."""
    found = pool.get(DevicePool.RELEASE_THRESHOLD)
    size_kb = 160
    n = max(2, args.total_mb * 1024 // size_kb)
    for label, threshold in (("as found", found), ("max", 2**64 - 1)):
        pool.set_threshold(threshold)
        for rep in range(2):
            made = arrays(n, size_kb, 4096 * (rep + 3) + (17 if threshold == found else 29))
            del made
            mx.clear_cache()          # back to the pool (cudaFreeAsync)
            mx.synchronize()          # where the pool trims to its threshold
            reserved = pool.get(DevicePool.RESERVED_MEM_CURRENT)
            spent, made = timed_alloc(n, size_kb, 4096 * (rep + 5) + 33)
            case("alloc after a sync", size_kb, n, spent, threshold=label, rep=rep,
                 pool_reserved_before=reserved,
                 pool_reserved_after=pool.get(DevicePool.RESERVED_MEM_CURRENT))
            del made
    pool.set_threshold(found)


def device_cases(args: argparse.Namespace, cap: int | None, seed: list[int]) -> None:
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
    dropped, busy = drop_while_busy(batch, args.busy_dim)
    case("free, cache full, device busy", size_kb, n, dropped, **busy)
    # the whole cache back to the device at once (what a periodic clear_cache costs)
    if cap is not None:
        fill_cache(cap, seed)
    held = mx.get_cache_memory()
    t0 = time.perf_counter()
    mx.clear_cache()
    print(json.dumps({"case": "clear_cache", "cache_bytes": held,
                      "ms": round(1000 * (time.perf_counter() - t0), 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=int, default=2048, help="bytes freed per case")
    ap.add_argument("--cache-cap-gb", type=float, default=None,
                    help="MLX's buffer cache cap (default: pipeserve's, 10%% of the device on "
                         "CUDA; MLX's own elsewhere)")
    ap.add_argument("--busy-dim", type=int, default=0,
                    help="side of the matmuls that keep the device busy (default: 8192 on a GPU, "
                         "512 elsewhere)")
    ap.add_argument("--only", choices=["all", "device", "unified", "pool"], default="all",
                    help="which group of cases to run")
    args = ap.parse_args()
    args.busy_dim = args.busy_dim or (8192 if mx.default_device().type == mx.DeviceType.gpu
                                      else 512)
    from pipeserve.memory import buffer_cache_limit
    cap = (int(args.cache_cap_gb * 1e9) if args.cache_cap_gb is not None
           else buffer_cache_limit(None))
    if cap is not None:
        mx.set_cache_limit(cap)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "cache_cap_bytes": cap}), flush=True)
    seed = [0]
    if args.only in ("all", "device"):
        device_cases(args, cap, seed)
    if args.only in ("all", "unified"):
        unified_cases(args, cap, seed)
    if args.only in ("all", "pool"):
        pool = device_pool()
        if pool is not None:
            pool_cases(args, pool)
        else:
            print(json.dumps({"case": "alloc after a sync", "skipped": "no CUDA device pool"}),
                  flush=True)


if __name__ == "__main__":
    main()
