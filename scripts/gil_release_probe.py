"""What an MLX call that gives the GIL up costs the engine thread when another thread is busy
running Python (the event loop of a server streaming many responses), no model: each call
alone, then beside a thread that never waits. MLX's eval, async_eval and the host reads
(tolist, item) release the GIL; getting it back from a thread that does not give it up waits
for that thread's switch interval (sys.getswitchinterval(), 5 ms by default).

Rows: `eval` of a ready array, `tolist` of a ready 64-row padding, `item` of a new lazy element
(a device round trip), and a batch's padding read back the two ways the row store has had:
`per layer` (mlx-lm's extract and filter: an eval and a tolist per layer) and `one read` (one
eval for every layer, then each ready array read: pipeserve/core/rows.py host_padding), each
after a filter left every layer's padding still to compute. µs per call.

    python scripts/gil_release_probe.py --layers 36
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeserve  # noqa: E402,F401  (its CPU BLAS choice comes before mlx.core)
import mlx.core as mx  # noqa: E402

from pipeserve.core.rows import host_padding  # noqa: E402


class Padded:
    def __init__(self, rows: int) -> None:
        self.left_padding = mx.arange(rows)


def timings(call: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    ready = mx.arange(args.rows)
    mx.eval(ready)
    layers = [Padded(args.rows) for _ in range(args.layers)]
    mx.eval([c.left_padding for c in layers])

    keep = mx.arange(args.rows)

    def filtered() -> None:   # each layer's padding as a filter leaves it: not computed yet
        for c in layers:
            c.left_padding = c.left_padding[keep]

    def per_layer() -> None:
        filtered()
        for c in layers:
            mx.eval(c.left_padding)
            c.left_padding.tolist()

    def one_read() -> None:
        filtered()
        host_padding(layers)

    calls: dict[str, Callable[[], object]] = {
        "eval (ready)": lambda: mx.eval(ready),
        "tolist (ready)": ready.tolist,
        "item (lazy)": lambda: (ready[3] + 1).item(),
        f"padding after a filter, per layer ({args.layers})": per_layer,
        f"padding after a filter, one read ({args.layers})": one_read,
    }
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(50))

    print(f"switch interval {sys.getswitchinterval() * 1000:.1f} ms; µs per call")
    print("| call | alone mean | busy thread mean | busy p90 | busy max |")
    print("| --- | --- | --- | --- | --- |")
    alone = {name: timings(call, args.calls) for name, call in calls.items()}
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    busy = {name: timings(call, args.calls) for name, call in calls.items()}
    stop.set()
    spinner.join()
    for name in calls:
        b = sorted(busy[name])
        print(f"| {name} | {statistics.mean(alone[name]) * 1e6:.1f} | "
              f"{statistics.mean(b) * 1e6:.1f} | {b[int(len(b) * 0.9)] * 1e6:.1f} | "
              f"{b[-1] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
