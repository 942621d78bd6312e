"""Gather against grouping for a batch whose rows use different LoRA adapters.

One decode step of B rows spread over N adapters, at a fixed context, two ways:
- gather (what pipeserve does): one forward over all B rows; every MultiLoRALinear shares the
  base matmul and adds each row's own low-rank delta, its A/B gathered by slot;
- grouped: the rows split by adapter, one forward per group over its own batched caches, each
  with its adapter's own rank-r matrices (what a server that groups rows by adapter set runs;
  the cost of splitting and re-merging the KV batch is left out, so grouping's figure is a
  lower bound).
Run on the device whose figures you want; prints one line per N with ms/step and tok/s:

    python scripts/lora_gather_vs_group.py --size small --rows 16 --adapters 1,4,8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeserve.model.config import ComputeDType, ModelConfig  # noqa: E402  (first: the CPU BLAS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.utils import load_model

    from pipeserve.bench.run import _write_adapters
    from pipeserve.adapters.lora import mount_all
    from pipeserve.model.loader import _cast_weights
    from pipeserve.model.tiny.text import ensure_model

    model_dir = ensure_model(args.arch, args.size, args.dtype, None)
    tmp = Path(tempfile.mkdtemp(prefix="lora-gather-"))
    vocab_probe, _ = load_model(model_dir)
    vocab = vocab_probe.args.vocab_size
    del vocab_probe
    print(f"model {args.arch}/{args.size}/{args.dtype}, {args.rows} rows, context "
          f"{args.context}, device {mx.default_device()}")
    for n in [int(x) for x in args.adapters.split(",")]:
        ids = _write_adapters(model_dir, tmp / f"n{n}", n)
        model, _ = load_model(model_dir)
        _, shared = mount_all(model, str(tmp / f"n{n}"), ids, None)
        _cast_weights(model, ModelConfig(compute_dtype=ComputeDType.checkpoint))
        slots = [(1 + i % n,) for i in range(args.rows)]
        groups = [[i for i, s in enumerate(slots) if s == (g,)] for g in range(1, n + 1)]

        def caches(rows: int) -> list:
            c = [BatchKVCache(left_padding=[0] * rows) for _ in model.layers]
            shared.select([(0,)] * rows)
            model(mx.random.randint(0, vocab, (rows, args.context)), cache=c)
            mx.eval([x.state for x in c])
            return c

        whole = caches(args.rows)
        parts = [caches(len(g)) for g in groups]
        tokens = mx.random.randint(0, vocab, (args.rows, 1))

        def gather() -> None:
            shared.select(slots)
            out = model(tokens, cache=whole)
            mx.eval(out)
            for c in whole:
                c.trim(1)

        def grouped() -> None:
            outs = []
            for g, (rows, c) in enumerate(zip(groups, parts), start=1):
                shared.select([(g,)] * len(rows))
                outs.append(model(tokens[mx.array(rows)], cache=c))
            mx.eval(outs)
            for c in parts:
                for x in c:
                    x.trim(1)

        timing = {}
        for name, fn in [("gather", gather), ("grouped", grouped)]:
            for _ in range(3):
                fn()   # warm-up: kernels, allocator
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            timing[name] = statistics.median(times)
        shared.reset()
        g, s = timing["gather"], timing["grouped"]
        print(f"{n} adapter(s): gather {g * 1e3:.1f} ms/step ({args.rows / g:.0f} tok/s), "
              f"grouped {s * 1e3:.1f} ms/step ({args.rows / s:.0f} tok/s): "
              f"{'gather' if g <= s else 'grouped'} faster by {max(g, s) / min(g, s):.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
