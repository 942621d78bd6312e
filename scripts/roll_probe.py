"""What rolling a right-padded group's padding to the left costs: mlx-lm's `dynamic_roll`
(an element gather) against pipeserve's `roll_rows` (one gather of whole vectors,
pipeserve/kv/padded.py), over every layer's keys and values of one group. Prints one JSON
line per method and rep (host build time, time until on the device), then whether both gave
the same arrays. GPU or CPU; the 0.6B shape's 60-row group by default:

    python scripts/roll_probe.py --rows 60 --heads 8 --positions 896 --dim 128 --layers 28
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeserve.kv.padded import roll_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--positions", type=int, default=896, help="the buffer's length")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    shape = (args.rows, args.heads, args.positions, args.dim)
    tensors = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * args.layers)]
    shifts = mx.array([(i * 7) % 30 for i in range(args.rows)], dtype=mx.int32)
    mx.eval(tensors, shifts)
    methods = {
        "mlx-lm dynamic_roll": lambda: [dynamic_roll(x, shifts[:, None], axis=2)
                                        for x in tensors],
        "pipeserve roll_rows": lambda: [y for k, v in zip(tensors[::2], tensors[1::2])
                                        for y in roll_rows([k, v], shifts)],
    }
    out = {}
    for rep in range(args.reps):
        for name, roll in methods.items():
            mx.synchronize()
            t0 = time.perf_counter()
            rolled = roll()
            built = time.perf_counter()
            mx.eval(rolled)
            mx.synchronize()
            out[name] = rolled
            print(json.dumps({"method": name, "rep": rep, "shape": list(shape),
                              "tensors": len(tensors),
                              "build_ms": round(1000 * (built - t0), 1),
                              "total_ms": round(1000 * (time.perf_counter() - t0), 1),
                              "device": str(mx.default_device())}), flush=True)
    stock, ours = out.values()
    print(json.dumps({"same": all(mx.array_equal(a, b).item() for a, b in zip(stock, ours))}),
          flush=True)


if __name__ == "__main__":
    main()
