"""What a second thread that wakes every step costs an engine-like thread through the GIL, with
no MLX and no model (issue 39): the "engine" does BUSY ms of Python (the graph build, GIL held),
then FREE ms with the GIL released (the device call), then posts one 100-byte message through
one of the ways pipeserve posts a step:

  none     nothing (the engine's own period)
  sender   a SimpleQueue to a thread that writes a pipe read by another process (the process
           core's child: pipeserve/pool/child.py Sender)
  direct   the engine thread writes that pipe itself
  asyncio  call_soon_threadsafe onto asyncio's own loop in the main thread (engine_alone.py)
  uvloop   the same onto uvloop's (the server's thread core, under Sanic)

One line each: the engine's step period p50, how often messages were delivered, and how long
after its post a message was delivered (p50). A machine where a hand-off is slow (a thread's
wake-up, a forced GIL switch) shows it as an engine period above `none`'s.

    for m in none sender direct asyncio uvloop; do python scripts/gil_handoff_probe.py $m 4.5 0.05; done
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import sys
import threading
import time
from typing import Any, Callable

STEPS = 300


def spin(n: int) -> None:
    x = 0
    for _ in range(n):
        x += 1


def spins_per_s() -> float:
    best = 1e9
    for _ in range(20):
        t = time.thread_time()
        spin(100_000)
        best = min(best, time.thread_time() - t)
    return 100_000 / best


def engine(post: Callable[[bytes], Any], busy: int, free: float) -> list[float]:
    out = []
    for _ in range(STEPS):
        spin(busy)          # a fixed amount of Python: a lost GIL makes it longer
        time.sleep(free)    # the GIL released
        out.append(time.perf_counter())
        post(b"x" * 100)
    return out


def reader(conn: Any) -> None:
    while True:
        try:
            conn.recv_bytes()
        except EOFError:
            return


def run(mode: str, busy: int, free: float) -> tuple[list[float], list[float]]:
    got: list[float] = []
    if mode == "none":
        return engine(lambda m: None, busy, free), got
    if mode in ("sender", "direct"):
        a, b = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=reader, args=(b,))
        proc.start()
        b.close()
        if mode == "sender":
            q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

            def write() -> None:
                while (d := q.get()) is not None:
                    a.send_bytes(d)
                    got.append(time.perf_counter())
            th = threading.Thread(target=write, daemon=True)
            th.start()
            sent = engine(q.put, busy, free)
            q.put(None)
            th.join()
        else:
            sent = engine(lambda m: (a.send_bytes(m), got.append(time.perf_counter())), busy,
                          free)
        a.close()
        proc.join()
        return sent, got

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        box: list[list[float]] = []

        def post(m: bytes) -> None:
            loop.call_soon_threadsafe(lambda: got.append(time.perf_counter()))
        th = threading.Thread(target=lambda: box.append(engine(post, busy, free)), daemon=True)
        th.start()
        while th.is_alive():
            await asyncio.sleep(0.05)
        return box[0]
    if mode == "uvloop":
        import uvloop
        return uvloop.run(main()), got
    return asyncio.run(main()), got


def p50(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["none", "sender", "direct", "asyncio", "uvloop"])
    ap.add_argument("busy_ms", type=float)
    ap.add_argument("free_ms", type=float)
    ap.add_argument("--switch-ms", type=float, default=5.0, help="sys.setswitchinterval")
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_ms / 1000)
    busy = int(spins_per_s() * args.busy_ms / 1000)
    sent, got = run(args.mode, busy, args.free_ms / 1000)
    period = p50([b - a for a, b in zip(sent[10:], sent[11:])])
    every = p50([b - a for a, b in zip(got[10:], got[11:])])
    lag = p50([g - s for s, g in zip(sent, got)])
    print(f"{args.mode:7s} busy {args.busy_ms} ms free {args.free_ms} ms switch "
          f"{args.switch_ms} ms: engine step {1000 * period:.2f} ms, delivered every "
          f"{1000 * every:.2f} ms, {1000 * lag:.2f} ms after the post", flush=True)


if __name__ == "__main__":
    cli()
