"""PNG plots from bench.py's own tables (matplotlib, headless).

- A `-m` sweep: `sweep.png` — aggregate tokens/s and TTFT p50/p95 against the swept value, one
  line per combination of the other swept groups (rebuilt after every job of the sweep, so the
  last job leaves the whole picture).
- A single run: `latency.png` — each request's TTFT and end-to-end latency against the time it
  was sent, one colour per target (pipeserve, mlx_lm.server).
"""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _num(v: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _parse(overrides: str) -> dict[str, str]:
    out = {}
    for item in overrides.split():
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def swept_keys(rows: list[dict[str, str]]) -> list[str]:
    """Override keys whose value differs between rows, in the order they first appear."""
    parsed = [_parse(r.get("overrides", "")) for r in rows]
    keys: list[str] = []
    for p in parsed:
        keys += [k for k in p if k not in keys]
    return [k for k in keys if len({p.get(k, "") for p in parsed}) > 1]


def _axis_order(values: list[str]) -> list[str]:
    uniq = list(dict.fromkeys(values))
    if all(not math.isnan(_num(v)) for v in uniq):
        return sorted(uniq, key=_num)
    return uniq


def sweep_series(rows: list[dict[str, str]]) -> tuple[str, list[str], dict[str, dict[str, list[float]]]]:
    """What sweep.png draws: the x key, its values in order, and per line (a combination of
    the other swept keys) the tok/s and TTFT p50/p95 at each x (nan where the sweep has none)."""
    keys = swept_keys(rows)
    parsed = [_parse(r["overrides"]) for r in rows]

    def rank(k: str) -> tuple[bool, int]:   # x: the key with most values, numeric preferred
        vals = {p.get(k, "") for p in parsed}
        return (all(not math.isnan(_num(v)) for v in vals), len(vals))
    x_key = max(keys, key=rank)
    others = [k for k in keys if k != x_key]
    order = _axis_order([p.get(x_key, "") for p in parsed])
    targets = len({r.get("target", "pipeserve") for r in rows}) > 1   # mlx_lm.server ran too
    lines: dict[str, dict[str, list[float]]] = {}
    for p, r in zip(parsed, rows):
        label = ", ".join([r.get("target", "pipeserve")] * targets
                          + [f"{k}={p.get(k, '')}" for k in others]) or "pipeserve"
        line = lines.setdefault(label, {c: [math.nan] * len(order)
                                        for c in ("agg_tok_s", "ttft_p50_s", "ttft_p95_s")})
        i = order.index(p.get(x_key, ""))
        for c in line:
            line[c][i] = _num(r[c])
    return x_key, order, lines


def plot_sweep(out: Path) -> Path | None:
    """sweep.png from sweep.csv (this sweep's rows: pipeserve's, and mlx_lm.server's when it
    ran); None when it holds no sweep yet."""
    path = out / "sweep.csv"
    if not path.exists():
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if len(rows) < 2 or not swept_keys(rows):
        return None
    x_key, order, lines = sweep_series(rows)
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(order)))
    for label, line in lines.items():
        ax1.plot(xs, line["agg_tok_s"], marker="o", label=label)
        drawn, = ax2.plot(xs, line["ttft_p50_s"], marker="o", label=f"{label} p50")
        ax2.plot(xs, line["ttft_p95_s"], marker="^", linestyle="--", color=drawn.get_color(),
                 label=f"{label} p95")
    for ax, title, unit in ((ax1, "aggregate throughput", "tokens/s"),
                            (ax2, "time to first token", "seconds")):
        ax.set_xticks(xs, order)
        ax.set_xlabel(x_key)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench.py sweep, workload {rows[0]['workload']}")
    fig.tight_layout()
    target = out / "sweep.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def latency_xlim(starts: list[float]) -> tuple[float, float]:
    """latency.png's x range: from 0, at least one second wide."""
    last = max(starts, default=0.0)
    return -0.02 * max(last, 1.0), max(last * 1.05, 1.0)


def plot_latency(out: Path) -> Path | None:
    """latency.png from requests.csv (one row per timed request)."""
    path = out / "requests.csv"
    if not path.exists():
        return None
    with open(path) as f:
        reqs = list(csv.DictReader(f))
    if not reqs:
        return None
    by_target: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in reqs:
        by_target[r["target"]].append(r)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for target, rs in by_target.items():
        starts = [_num(r["start_s"]) for r in rs]
        line, = ax.plot(starts, [_num(r["latency_s"]) for r in rs], "o", label=f"{target}: total")
        ax.plot(starts, [_num(r["ttft_s"]) for r in rs], "x", color=line.get_color(),
                label=f"{target}: TTFT")
    # from 0, at least a second wide: one request (or a burst sent together) is a point on a
    # readable axis, not a dot on an axis of microseconds
    ax.set_xlim(*latency_xlim([_num(r["start_s"]) for r in reqs]))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("request sent at (s after the first)")
    ax.set_ylabel("seconds")
    ax.set_title("per-request latency")
    ax.grid(alpha=.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    target = out / "latency.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def write_requests(out: Path, target: str, per_request: list[dict[str, float]]) -> None:
    path = out / "requests.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["target", "start_s", "ttft_s", "latency_s", "tokens"])
        if new:
            w.writeheader()
        for r in per_request:
            w.writerow({"target": target, **{k: round(v, 4) for k, v in r.items()}})
