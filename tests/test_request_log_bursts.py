"""scripts/request_log_bursts.py groups a server log's request lines into bursts: the lines
are written by the server's own formatters (text and JSON) from records shaped as the request
log makes them; each burst's size, its gap after the previous burst's end, its arrival spread
and its first-token p50 come out in the server's clock."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve.launch.logs import formatter

ROOT = Path(__file__).resolve().parent.parent


def record(end: float, total: float, ttft: float | None, prompt: int = 76) -> logging.LogRecord:
    fields = {"endpoint": "completions", "outcome": "ok" if ttft is not None else "rejected",
              "prompt_tokens": prompt, "cached_tokens": 0, "generated_tokens": 4,
              "ttft_s": ttft, "total_s": total, "finish": "length"}
    text = " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
    rec = logging.makeLogRecord({"name": "pipeserve", "levelno": logging.INFO,
                                 "levelname": "INFO", "msg": "request %s %s",
                                 "args": ("cmpl-x", text), "event": "request", **fields})
    rec.created, rec.msecs = end, (end % 1) * 1000
    return rec


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_two_bursts_and_the_gap_between_them(tmp_path: Path, fmt: str) -> None:
    t = 1_700_000_000.0
    recs = [record(t + 0.50 + i * 0.01, 0.50, 0.30) for i in range(3)]   # started t..t+0.02
    recs.append(record(t + 0.60, 0.05, None))   # refused: no first token, not counted
    recs += [record(t + 1.40 + i * 0.01, 0.50, 0.20, prompt=80) for i in range(2)]  # t+0.9..
    f = formatter(fmt)
    log = tmp_path / "pipeserve.log"
    log.write_text("noise before\n" + "\n".join(f.format(r) for r in recs) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "request_log_bursts.py"),
                          str(log)], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["requests"] for r in rows] == [3, 2]
    assert [r["prompt_tokens"] for r in rows] == [76, 80]
    assert rows[0]["after_previous_end_s"] is None
    # the second burst's first handler started 0.9 s in; the first burst ended at 0.52
    assert rows[1]["after_previous_end_s"] == pytest.approx(0.38, abs=0.002)
    assert rows[0]["arrival_spread_s"] == pytest.approx(0.02, abs=0.002)
    assert [r["ttft_p50_s"] for r in rows] == pytest.approx([0.30, 0.20], abs=0.002)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_steps_listed_with_the_burst_they_served(tmp_path: Path, fmt: str) -> None:
    """--steps: the engine's step lines (scheduler.step_trace, as core/step_trace.py logs them)
    from a burst's first arrival to its last first token, in ms after that arrival; queue_s's
    p50 beside the first-token p50."""
    from pipeserve.core.step_trace import StepTrace
    t = 1_700_000_000.0
    recs = []
    for i in range(3):   # handlers started t..t+0.02, first tokens t+0.30..t+0.32
        rec = record(t + 0.50 + i * 0.01, 0.50, 0.30)
        rec.queue_s = 0.05 + i * 0.01
        rec.args = (rec.args[0], rec.args[1].replace(" total_s=", f" queue_s={rec.queue_s} total_s="))
        recs.append(rec)
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append   # type: ignore[method-assign]
    steps_log = logging.getLogger("pipeserve.steps")
    steps_log.addHandler(handler)
    steps_log.setLevel(logging.INFO)
    try:
        for at, rows, prompt_rows, tokens in ((0.1, 3, 3, 225), (0.31, 3, 0, 0), (0.35, 3, 0, 0),
                                               (0.39, 3, 0, 0), (0.49, 3, 0, 0)):
            tr = StepTrace()
            tr.begin()
            tr.mark("inbox")
            tr.mark("launch")
            tr.wall = t + at - tr.parts[0][1]   # the step's wall clock: `at` once its inbox ended
            tr.end(rows, prompt_rows, tokens, taken=3 if prompt_rows else 0)
    finally:
        steps_log.removeHandler(handler)
    f = formatter(fmt)
    log = tmp_path / "pipeserve.log"
    log.write_text("\n".join(f.format(r) for r in sorted(recs + lines, key=lambda r: r.created))
                   + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "request_log_bursts.py"),
                          "--steps", str(log)], capture_output=True, text=True, check=True).stdout
    [row] = [json.loads(line) for line in out.splitlines()]
    assert row["queue_p50_s"] == pytest.approx(0.06)
    assert [s[:4] for s in row["steps"]] == [[100.0, 3, 3, 225], [310.0, 3, 0, 0]]
    # the burst's steps from its first arrival to its last response: one carried the prompts;
    # the decode steps began 40, 40 and 100 ms apart: the long one shows in the mean and max
    assert row["decode"]["steps"] == 5 and row["decode"]["prompt_steps"] == 1
    assert row["decode"]["rows_max"] == 3
    assert row["decode"]["decode_interval_ms_p50"] == pytest.approx(40.0, abs=0.5)
    assert row["decode"]["decode_interval_ms_mean"] == pytest.approx(60.0, abs=0.5)
    assert row["decode"]["decode_interval_ms_max"] == pytest.approx(100.0, abs=0.5)
    assert row["decode"]["decode_intervals_long"] == 1
