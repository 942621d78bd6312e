"""A server log's request lines (one a finished request: its total and first-token times, by
the server's clock) grouped into bursts: requests whose handlers started within --gap seconds
of the one before belong to one burst. Per burst, one JSON line: its size, prompt and cached
tokens, how long after the previous burst's last response ended its first handler started
(the server's share of a client's turnaround), how spread its arrivals were, its first-token
p50 and spread. Reads the text format and server.log_format=json.

    python scripts/request_log_bursts.py bench-out/8b/pipeserve.log

With `--steps` (a server run with scheduler.step_trace=true), each burst also lists the engine
steps from its first arrival to its last first token: [ms after its first arrival, rows, prompt
rows, prompt tokens, {part: ms}], to tell a slow forward from a late start, and a `decode`
summary of the steps from its first arrival to its last response (`summary` below). With
`--steps-only` (a log with step lines and no request lines: scripts/engine_alone.py's stderr,
bench.py's engine-alone-N.log), the steps are grouped by --gap alone and each group summarized.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

TEXT = re.compile(r"^\[(?P<at>[\d-]+ [\d:,]+)\].* - request \S+ (?P<fields>.*)$")
STEP = re.compile(r"step: at=(?P<at>[\d.]+) (?P<parts>.*?) rows=(?P<rows>\d+) "
                  r"prompt_rows=(?P<prompt_rows>\d+) tokens=(?P<tokens>\d+)")


@dataclass
class Done:
    start: float      # the handler's start (its end minus its total)
    first: float      # its first token (start + ttft)
    end: float
    prompt: int
    cached: int
    queue: float | None = None   # arrival until it had a row (queue_s), where the log has it


@dataclass
class Step:
    at: float
    rows: int
    prompt_rows: int
    tokens: int
    parts: dict[str, float]


def steps(lines: Iterator[str]) -> Iterator[Step]:
    """The engine's step lines (scheduler.step_trace), text or JSON."""
    for line in lines:
        if line.startswith("{"):
            try:
                line = str(json.loads(line).get("msg", ""))
            except ValueError:
                continue
        m = STEP.search(line)
        if m is not None:
            parts = dict(kv.split("=", 1) for kv in m["parts"].split() if "=" in kv)
            yield Step(float(m["at"]), int(m["rows"]), int(m["prompt_rows"]), int(m["tokens"]),
                       {k: float(v) for k, v in parts.items()})


def summary(trace: list[Step]) -> dict[str, object]:
    """Steps in a row: how many, how many carried a prompt, the median, mean and longest wall
    between one decode step's start and the next's (a decode step's length as clients feel it;
    a mean above the median is a few long steps), how many of those gaps were over 1.5x the
    median, and each part's median ms over the steps that carried no prompt."""
    decode = [t for t in trace if t.prompt_rows == 0]
    gaps = [(b.at - a.at) * 1000 for a, b in zip(trace, trace[1:])
            if a.prompt_rows == 0 and b.prompt_rows == 0]
    parts = sorted({k for t in decode for k in t.parts})
    p50 = statistics.median(gaps) if gaps else None
    return {"steps": len(trace), "prompt_steps": len(trace) - len(decode),
            "rows_max": max((t.rows for t in trace), default=0),
            "decode_interval_ms_p50": round(p50, 2) if p50 is not None else None,
            "decode_interval_ms_mean": round(statistics.fmean(gaps), 2) if gaps else None,
            "decode_interval_ms_max": round(max(gaps), 2) if gaps else None,
            "decode_intervals_long": sum(g > 1.5 * p50 for g in gaps) if p50 is not None else 0,
            "decode_parts_ms_p50": {k: round(statistics.median(t.parts.get(k, 0.0)
                                                               for t in decode), 2)
                                    for k in parts}}


def step_groups(trace: list[Step], gap: float) -> list[list[Step]]:
    """Steps split where the engine ran none for `gap` seconds."""
    groups: list[list[Step]] = []
    for t in sorted(trace, key=lambda t: t.at):
        if groups and t.at - groups[-1][-1].at < gap:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def requests(lines: Iterator[str]) -> Iterator[Done]:
    for line in lines:
        fields: dict[str, str] = {}
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") != "request":
                continue
            at = datetime.fromisoformat(str(rec["ts"])).timestamp()
            fields = {k: str(v) for k, v in rec.items()}
        else:
            m = TEXT.match(line)
            if m is None:
                continue
            at = datetime.strptime(m["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            fields = dict(kv.split("=", 1) for kv in m["fields"].split() if "=" in kv)
        if fields.get("ttft_s") in (None, "-", "None") or fields.get("total_s") is None:
            continue   # refused or failed before a token: no first token to time
        total, ttft = float(fields["total_s"]), float(fields["ttft_s"])
        cached = fields.get("cached_tokens", "0")
        queue = fields.get("queue_s")
        yield Done(at - total, at - total + ttft, at, int(fields.get("prompt_tokens", 0)),
                   int(cached) if cached.isdigit() else 0,
                   float(queue) if queue not in (None, "-", "None") else None)


def bursts(done: list[Done], gap: float,
           trace: list[Step] | None = None) -> list[dict[str, object]]:
    done = sorted(done, key=lambda d: d.start)
    groups: list[list[Done]] = []
    for d in done:
        if groups and d.start - groups[-1][-1].start < gap:
            groups[-1].append(d)
        else:
            groups.append([d])
    out: list[dict[str, object]] = []
    prev_end = None
    for g in groups:
        start = min(d.start for d in g)
        firsts = [d.first - d.start for d in g]
        out.append({
            "requests": len(g), "prompt_tokens": g[0].prompt, "cached_tokens": g[0].cached,
            "after_previous_end_s": round(start - prev_end, 3) if prev_end is not None else None,
            "arrival_spread_s": round(max(d.start for d in g) - start, 3),
            "ttft_p50_s": round(statistics.median(firsts), 3),
            "first_token_spread_s": round(max(d.first for d in g) - min(d.first for d in g), 3),
            "wall_s": round(max(d.end for d in g) - start, 3)})
        queues = [d.queue for d in g if d.queue is not None]
        if queues:
            out[-1]["queue_p50_s"] = round(statistics.median(queues), 3)
        if trace is not None:
            last = max(d.first for d in g)
            out[-1]["steps"] = [[round((t.at - start) * 1000, 1), t.rows, t.prompt_rows,
                                 t.tokens, t.parts] for t in trace if start <= t.at <= last]
            end = max(d.end for d in g)
            out[-1]["decode"] = summary([t for t in trace if start <= t.at <= end])
        prev_end = max(d.end for d in g)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the server's log (pipeserve.log, or serve.py's output)")
    ap.add_argument("--gap", type=float, default=0.25,
                    help="seconds between two handlers' starts that split bursts")
    ap.add_argument("--steps", action="store_true",
                    help="list each burst's engine steps (a log of scheduler.step_trace=true)")
    ap.add_argument("--steps-only", action="store_true",
                    help="no request lines: group the step lines by --gap and summarize each")
    args = ap.parse_args()
    with open(args.log, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    if args.steps_only:
        for group in step_groups(list(steps(iter(lines))), args.gap):
            print(json.dumps(summary(group)), flush=True)
        return
    trace = list(steps(iter(lines))) if args.steps else None
    for row in bursts(list(requests(iter(lines))), args.gap, trace):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
