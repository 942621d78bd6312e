"""Decode speed against the hot-expert cache size (model.expert_offload) on a generated
mixture-of-experts model of qwen3_moe's shape (docs/models.md, "Experts larger than memory").

    python scripts/expert_offload_bench.py OUT.csv            # the benchmark's shape
    python scripts/expert_offload_bench.py OUT.csv --quick    # the tiny shape, a few tokens

One process per row (so each peak is its own): the model fully loaded, then offloaded with a
cache of a share of its experts' bytes. Each row loads through pipeserve's loader, prefills a
16-token prompt and 4 tokens, then decodes 64 more greedy tokens with mlx-lm's generate_step and reports the
decode rate, the cache's hit rate and the expert bytes read per token, the weights admission
counts and MLX's peak memory. Random weights route near-uniformly: the hit rate is about the
cache's share, the worst case for a cache (trained models route less evenly)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeserve.model.tiny.moe import MoeShape  # noqa: E402

BENCH = MoeShape(hidden=256, layers=8, experts=32, top_k=4, expert_inter=256)
SHARES = (None, 1.0, 0.5, 0.25, 0.1)   # None: every expert loaded
QUICK_SHARES = (None, 0.5)
PROMPT = [(7 * i + 3) % 500 for i in range(16)]
WARM = 4   # tokens decoded before the timing starts
COLUMNS = ("cache", "cache_mb", "expert_mb", "weights_mb", "peak_mb", "decode_tok_s",
           "hit_rate", "mb_read_per_token")


def row(shape: MoeShape, share: float | None, tokens: int, cache_dir: str) -> dict[str, object]:
    """One measurement, in this process."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from pipeserve.model.config import ComputeDType, ModelConfig
    from pipeserve.model.experts import Stats, expert_bytes
    from pipeserve.model.loader import load
    from pipeserve.model.tiny.moe import ensure_moe_model

    path = ensure_moe_model(shape, cache_dir)
    total = _expert_total(path, expert_bytes)
    cache_mb = None if share is None else share * total / 1e6
    mx.reset_peak_memory()
    loaded = load(ModelConfig(name="moe", path=str(path), compute_dtype=ComputeDType.checkpoint,
                              expert_offload=share is not None,
                              expert_cache_mb=cache_mb or 1024.0))
    steps = generate_step(mx.array(PROMPT), loaded.model, max_tokens=tokens + WARM,
                          sampler=make_sampler(0.0))
    for _ in range(WARM):   # the prompt and the first tokens: not timed
        next(steps)
    if loaded.experts is not None:
        loaded.experts.stats = Stats()
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    elapsed = time.perf_counter() - t0
    stats = loaded.experts.stats if loaded.experts is not None else None
    return {"cache": "all loaded" if share is None else f"{share:.0%} of the experts",
            "cache_mb": "" if cache_mb is None else round(cache_mb, 1),
            "expert_mb": round(total / 1e6, 1), "weights_mb": round(loaded.weight_bytes / 1e6, 1),
            "peak_mb": round(mx.get_peak_memory() / 1e6, 1),
            "decode_tok_s": round(n / elapsed, 1),
            "hit_rate": "" if stats is None else round(stats.hit_rate, 3),
            "mb_read_per_token": "" if stats is None else round(stats.bytes_moved / n / 1e6, 2)}


def _expert_total(path: Path, expert_bytes: object) -> int:
    from mlx_lm.utils import load_model
    model, _ = load_model(path, lazy=True)
    return expert_bytes(model)   # type: ignore[operator]


def main(argv: list[str]) -> None:
    if argv[:1] == ["--row"]:   # a child: one row as JSON on stdout
        shape = MoeShape(**json.loads(argv[1]))
        share = None if argv[2] == "none" else float(argv[2])
        print(json.dumps(row(shape, share, int(argv[3]), argv[4])))
        return
    out = Path(argv[0])
    quick = "--quick" in argv
    shape, shares, tokens = (MoeShape(), QUICK_SHARES, 8) if quick else (BENCH, SHARES, 64)
    cache_dir = tempfile.mkdtemp(prefix="expert-offload-bench-")
    rows = []
    for share in shares:
        args = [sys.executable, __file__, "--row", json.dumps(shape.__dict__),
                "none" if share is None else str(share), str(tokens), cache_dir]
        done = subprocess.run(args, capture_output=True, text=True, check=True, timeout=600)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
