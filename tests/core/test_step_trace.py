"""scheduler.step_trace: one log line per engine step, with its wall clock, its parts'
milliseconds and who ran, so a server's steps line up with its request lines. Real engine,
real model."""
from __future__ import annotations

import asyncio
import logging
import re
import time

LINE = re.compile(r"step: at=(?P<at>[\d.]+) (?P<parts>.*?) rows=(?P<rows>\d+) "
                  r"prompt_rows=(?P<prompt_rows>\d+) tokens=(?P<tokens>\d+) taken=(?P<taken>\d+)$")
PROMPTS = [[11, 12, 13, 14, 15], [40 + i for i in range(37)], [7, 8, 9] * 5]


def steps(caplog) -> list[dict]:
    out = []
    for rec in caplog.records:
        if rec.name == "pipeserve.steps":
            m = LINE.match(rec.getMessage())
            assert m, rec.getMessage()
            parts = dict(p.split("=") for p in m["parts"].split())
            out.append({**{k: float(v) for k, v in m.groupdict().items() if k != "parts"},
                        "parts": {k: float(v) for k, v in parts.items()}})
    return out


def test_each_step_is_one_line_naming_its_rows_and_parts(engine_factory, caplog) -> None:
    h = engine_factory("scheduler.step_trace=true", "scheduler.arrival_gap_ms=100",
                       "scheduler.arrival_window_ms=2000")
    caplog.set_level(logging.INFO, logger="pipeserve.steps")
    before = time.time()
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=6) for p in PROMPTS]))
    assert [len(g["ids"]) for g in got] == [6, 6, 6]
    trace = steps(caplog)
    # the three arrivals are prefilled in one step: their prompts but the last token, which
    # the first decode step feeds and samples from
    first = trace[0]
    assert (first["rows"], first["prompt_rows"], first["taken"]) == (3, 3, 3), trace[:2]
    assert first["tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert "launch" in first["parts"] and "inbox" in first["parts"]
    # then one decode step per token, each of the three rows, no prompt
    decode = trace[1:]
    assert len(decode) == 6 and all(s["prompt_rows"] == 0 and s["rows"] == 3 for s in decode)
    assert before <= first["at"] <= min(s["at"] for s in decode) <= time.time()
    # the step that samples the three first tokens reads them back before the next step is
    # built (core/step.py first_tokens); the steps after it are pipelined: each is read back
    # in the next pass, after that pass's launch
    assert "apply_now" in decode[0]["parts"], decode[:2]
    assert all("apply_now" not in s["parts"] for s in decode[1:-1]), decode
    assert all("apply" in s["parts"] for s in decode[2:]), decode
    assert all(v >= 0 for s in trace for v in s["parts"].values())


def test_off_by_default(engine_factory, caplog) -> None:
    h = engine_factory()
    caplog.set_level(logging.INFO, logger="pipeserve.steps")
    h.generate(PROMPTS[0], max_tokens=3)
    assert steps(caplog) == []


def test_the_prompt_copies_after_a_prefill_are_their_own_part(engine_factory, caplog) -> None:
    """A prompt the cache keeps is copied out of the batch in the passes after its prefill
    (Step.between, a few rows a pass): the trace names that part `drain`, apart from the
    loop's other work (`rest`), so a GPU's first decode steps can be read part by part."""
    h = engine_factory("scheduler.step_trace=true")
    caplog.set_level(logging.INFO, logger="pipeserve.steps")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(4)]
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=6) for p in prompts]))
    assert [len(g["ids"]) for g in got] == [6] * 4
    trace = steps(caplog)
    drained = [s for s in trace if "drain" in s["parts"]]
    assert drained, trace
    assert all(s["parts"]["drain"] > 0 for s in drained), drained


def test_a_part_that_ran_is_named_however_short(caplog) -> None:
    """A step in flight applied in a few microseconds still shows `apply`: its line once left
    it out under 0.05 ms, as if nothing had been applied (a full-suite run read it so)."""
    from pipeserve.core.step_trace import StepTrace
    caplog.set_level(logging.INFO, logger="pipeserve.steps")
    tr = StepTrace()
    tr.begin()
    tr.mark("apply")
    tr.end(rows=1, prompt_rows=0, tokens=0, taken=0)
    (line,) = steps(caplog)
    assert "apply" in line["parts"] and line["parts"]["apply"] >= 0
