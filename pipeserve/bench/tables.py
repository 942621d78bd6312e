"""The result tables: one row per target, as Markdown and CSV under bench.out; the jobs of one
-m sweep add to one table."""
from __future__ import annotations

import csv
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from pipeserve.bench.config import BenchConfig, Row
from pipeserve.bench.workload import _pct


def _row(target: str, b: BenchConfig, m: dict[str, Any], rss: float, overrides: str,
         kv_bytes: float = float("nan")) -> Row:
    proposed, accepted = m.get("spec_proposed", 0), m.get("spec_accepted", 0)
    return Row(target, b.workload, b.streams, m["requests"], m["tokens"], round(m["wall"], 2),
               round(m["tokens"] / m["wall"], 2),
               round(statistics.median(m["per_stream"]), 2) if m["per_stream"] else float("nan"),
               round(_pct(m["ttft"], 0.5), 3), round(_pct(m["ttft"], 0.95), 3),
               round(_pct(m["itl"], 0.5), 1), round(_pct(m["itl"], 0.95), 1), round(rss, 1),
               overrides, round(m.get("prompt_tokens", float("nan")), 1),
               round(m.get("prefill", float("nan")), 1),
               round(m.get("decode_agg", float("nan")), 2), proposed, accepted,
               round(accepted / proposed, 3) if proposed else float("nan"), kv_bytes,
               m.get("errors", 0), round(m.get("decode_full", float("nan")), 2),
               round(m.get("host_steal", float("nan")), 3), m.get("host_probe_ms", float("nan")))


SUMMARY = ["target", "workload", "streams", "requests", "output_tokens", "agg_tok_s",
           "stream_tok_s_p50", "ttft_p50_s", "ttft_p95_s", "itl_p50_ms", "errors"]


def sweep_continues() -> bool:
    """Whether this job is a -m sweep's second or later: it adds to the files the sweep's first
    job started (the tables, and the server and engine-alone logs) instead of replacing them."""
    from hydra.types import RunMode
    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and hc.job.num > 0


def _new_tables(out: Path) -> None:
    """A run starts its own results.csv / results.md; the jobs of one -m sweep share them
    (the first job starts them)."""
    if not sweep_continues():
        for name in ("results.csv", "results.md"):
            (out / name).unlink(missing_ok=True)


def _write(out: Path, rows: list[Row]) -> None:
    for r in rows:
        print(f"bench: {r.target} done: {r.agg_tok_s} tok/s aggregate", flush=True)
    csv_path = out / "results.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    with open(csv_path) as f:
        all_rows = list(csv.DictReader(f))
    cols = list(all_rows[0].keys())
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r[c] for c in cols) + " |" for r in all_rows]
    (out / "results.md").write_text("\n".join(md) + "\n")
    # the terminal gets the headline columns; results.csv / results.md have every column
    short = ["| " + " | ".join(SUMMARY) + " |", "|" + "---|" * len(SUMMARY)]
    short += ["| " + " | ".join(r.get(c, "") for c in SUMMARY) + " |" for r in all_rows]
    print("\n".join(short) + f"\n(all {len(cols)} columns: {out / 'results.md'})")
