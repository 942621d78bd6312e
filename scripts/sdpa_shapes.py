"""What one attention call costs at a shape the process has not met, against the same shape
again: MLX's CUDA attention builds a cuDNN graph for each new (rows, query length, key length,
mask) and keeps MLX_CUDA_SDPA_CACHE_SIZE of them (MLX_CUDA_USE_CUDNN_SDPA=0 turns it off).
One JSON line per shape and mask kind. On the CPU it runs MLX's fallback, which builds nothing.

    python scripts/sdpa_shapes.py --shapes 128x76,128x77,1x300,1x301
"""
from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


def once(rows: int, length: int, heads: int, kv_heads: int, dim: int, mask_kind: str) -> float:
    """Milliseconds for one call at this shape, its inputs ready beforehand."""
    q = mx.random.normal((rows, heads, length, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, length, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, length, dim)).astype(mx.bfloat16)
    mask: str | mx.array = "causal"
    if mask_kind == "array":   # as a batched cache's make_mask gives it
        mask = create_causal_mask(length, offset=0, left_padding=mx.zeros((rows,), mx.int32))
        mx.eval(mask)
    mx.eval(q, k, v)
    t = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask))
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128x76,128x77,128x78,64x78,1x300,1x301,1x2048",
                    help="ROWSxLENGTH, comma-separated, in the order they are met")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for mask_kind in ("array", "causal"):
        for rows, length in shapes:
            first = once(rows, length, args.heads, args.kv_heads, args.dim, mask_kind)
            again = once(rows, length, args.heads, args.kv_heads, args.dim, mask_kind)
            print(json.dumps({"device": str(mx.default_device()),
                              "cudnn": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"),
                              "mask": mask_kind, "B": rows, "L": length,
                              "first_ms": round(first, 2), "again_ms": round(again, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
