"""The draft gate's decisions from given step timings (pipeserve/draft/gate.py, no model): a
bucket where drafting's goodput loses turns off, probes drafting after a wait that doubles while
it keeps losing, turns on again once drafting wins; plain probes keep measuring while it drafts;
buckets decide apart; idle gaps and prompt steps are not measured."""
from __future__ import annotations

import pytest

from pipeserve.draft import gate as g
from pipeserve.draft.gate import DraftGate, Report, bucket_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """Drives a gate as the draft stage does: choose, then the step takes `draft_s` seconds
    and emits `draft_tokens` per row when it drafts, `plain_s` / 1 per row when not."""

    def __init__(self, ratio: float = 0.95) -> None:
        self.clock = Clock()
        self.reports: list[Report] = []
        self.gate = DraftGate(ratio, clock=self.clock, report=self.reports.append)
        self.steps: list[bool] = []
        self.gate.record(1, None, 1)   # the rows' prompt step: the first decode step's interval

    def run(self, n: int, rows: int, draft_s: float, draft_tokens: float,
            plain_s: float = 0.01) -> list[bool]:
        out = []
        for _ in range(n):
            drafts = self.gate.choose(rows)
            self.gate.next_drafts(rows)
            self.clock.now += draft_s if drafts else plain_s
            self.gate.record(rows, drafts, round(rows * (draft_tokens if drafts else 1)))
            out.append(drafts)
        self.steps += out
        return out

    def switches(self) -> list[tuple[str, bool]]:
        return [(r.label, r.on) for r in self.reports if r.switched]


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 33)] == [0, 1, 1, 2, 2, 3, 3, 4, 5]
    e = Engine()
    for rows in (1, 3, 6, 9):
        e.gate.choose(rows)
    assert [r.label for r in e.reports] == ["1", "2-3", "4-7", "8-15"]


def test_a_losing_drafter_turns_off_after_its_first_plain_probe() -> None:
    """Drafting at half the plain goodput (a step 2× as long, one token per row): the first
    run drafts, the plain probe measures, the bucket turns off and decodes plainly."""
    e = Engine()
    steps = e.run(g.FIRST_RUN + g.PROBE_STEPS + 40, rows=1, draft_s=0.02, draft_tokens=1)
    assert steps[:g.FIRST_RUN] == [True] * g.FIRST_RUN
    assert not any(steps[g.FIRST_RUN:])
    assert e.switches() == [("1", False)]
    r = e.reports[-1]
    assert abs(r.draft_rate - 50) < 1e-6 and abs(r.plain_rate - 100) < 1e-6


def test_a_winning_drafter_stays_on_and_probes_plain_rarely() -> None:
    """Drafting that emits 3 tokens a row in 1.5× a plain step's time stays on; a plain probe of
    PROBE_STEPS comes every ON_RUN drafting steps (under 4% of steps)."""
    e = Engine()
    n = g.FIRST_RUN + 3 * (g.PROBE_STEPS + g.ON_RUN)
    steps = e.run(n, rows=4, draft_s=0.015, draft_tokens=3)
    assert e.switches() == []
    plain = steps.count(False)
    assert plain == 3 * g.PROBE_STEPS and plain / n < 0.04
    assert e.gate.buckets[2].on
    assert e.run(2, rows=4, draft_s=0.015, draft_tokens=3) == [False, False]   # the next probe
    assert e.gate.follows(4)   # (an on bucket's head is fed through its plain probes: no gap)


def plain_runs(steps: list[bool]) -> list[int]:
    """The lengths of the runs of plain steps that end in a drafting step."""
    waits, run = [], 0
    for drafts in steps:
        if drafts:
            if run:
                waits.append(run)
            run = 0
        else:
            run += 1
    return waits


def test_the_probe_wait_doubles_while_drafting_keeps_losing_up_to_a_bound() -> None:
    """A drafting step costs two plain ones here: the first wait is long enough that the
    3-step probe takes 5% of the time (120 steps, not OFF_MIN), then it doubles to OFF_MAX."""
    e = Engine()
    e.run(g.FIRST_RUN + g.PROBE_STEPS, rows=1, draft_s=0.02, draft_tokens=1)
    steps = e.run(20000, rows=1, draft_s=0.02, draft_tokens=1)
    waits = plain_runs(steps)
    first = g.MIN_SAMPLES * 2 / g.PROBE_SHARE
    assert first <= waits[0] <= first + 1
    for a, b in zip(waits, waits[1:]):
        assert b == min(g.OFF_MAX, 2 * a)
    assert waits[-2:] == [g.OFF_MAX, g.OFF_MAX]
    probe_s = 0.02 * g.MIN_SAMPLES
    assert probe_s / (waits[0] * 0.01) <= g.PROBE_SHARE   # the probing cost, at first
    assert probe_s / (g.OFF_MAX * 0.01) < 0.002           # and once the wait is at its bound
    assert e.switches() == [("1", False)]


def test_a_costly_drafting_step_waits_longer_before_its_probe() -> None:
    """A drafting step as long as 20 plain ones: 1200 plain steps before the first probe."""
    e = Engine()
    e.run(g.FIRST_RUN + g.PROBE_STEPS, rows=8, draft_s=0.2, draft_tokens=1.2)
    assert e.switches() == [("8-15", False)]
    waits = plain_runs(e.run(2000, rows=8, draft_s=0.2, draft_tokens=1.2))
    assert 1200 <= waits[0] <= 1201


def test_a_drafter_whose_acceptance_rises_turns_back_on() -> None:
    e = Engine()
    e.run(g.FIRST_RUN + g.PROBE_STEPS + 10, rows=1, draft_s=0.02, draft_tokens=1)
    assert not e.gate.buckets[0].on
    wait = e.gate.buckets[0].wait
    steps = e.run(wait + 20, rows=1, draft_s=0.02, draft_tokens=4)   # now 2× plain
    assert e.switches() == [("1", False), ("1", True)]
    assert steps[-10:] == [True] * 10


def test_the_margin_keeps_a_drafter_that_is_almost_even() -> None:
    """Drafting 3% slower than plain stays on (ratio 0.95); 10% slower turns off."""
    even = Engine()
    even.run(300, rows=2, draft_s=0.0103, draft_tokens=1)
    assert even.switches() == []
    slower = Engine()
    slower.run(300, rows=2, draft_s=0.011, draft_tokens=1)
    assert slower.switches() == [("2-3", False)]


def test_buckets_decide_apart() -> None:
    """One row: drafting wins; eight rows: it loses (a compute-bound batch)."""
    e = Engine()
    for _ in range(20):
        e.run(10, rows=1, draft_s=0.015, draft_tokens=3)
        e.run(10, rows=8, draft_s=0.03, draft_tokens=1.2)
    assert e.switches() == [("8-15", False)]
    assert e.gate.buckets[0].on and not e.gate.buckets[3].on


def test_the_step_before_a_drafting_probe_brings_its_tokens_to_the_host() -> None:
    """next_drafts says, at each step, whether the next one drafts: true before each drafting
    step that follows a plain one (that plain step must sync), false through the rest of a
    plain run (it pipelines) but for the probe that turned drafting off (it expected drafting
    to go on)."""
    e = Engine()
    gate, clock = e.gate, e.clock
    chosen, ahead = [], []
    for _ in range(200):
        drafts = gate.choose(1)
        ahead.append(gate.next_drafts(1))
        clock.now += 0.02 if drafts else 0.01
        gate.record(1, drafts, 1)
        chosen.append(drafts)
    after_plain = [i for i in range(len(chosen) - 1) if not chosen[i] and chosen[i + 1]]
    assert after_plain and all(ahead[i] for i in after_plain)
    pipelined = [i for i in range(len(chosen) - 1) if not chosen[i] and not chosen[i + 1]]
    # (a plain probe that turns drafting off had said drafting would go on: one sync too many)
    assert len(pipelined) > 100 and sum(ahead[i] for i in pipelined) <= len(e.switches()) == 1


def test_idle_gaps_prompt_steps_and_the_first_plain_step_after_a_verify_are_not_measured() -> None:
    e = Engine()
    gate, clock = e.gate, e.clock
    gate.record(1, True, 2)   # the first completion: no interval yet
    clock.now += 5.0
    gate.record(1, None, 9)   # a step with a prompt chunk: starts the next interval only
    assert 0 not in gate.buckets
    clock.now += 0.02
    gate.record(1, True, 2)
    assert gate.buckets[0].draft.n == 1 and gate.buckets[0].draft.value == pytest.approx(100)
    clock.now += 0.02
    gate.record(1, False, 1)   # after a verify: the pipeline restarts
    assert gate.buckets[0].plain.n == 0
    gate.pause()               # the engine idles for a minute
    clock.now += 60
    gate.record(1, False, 1)
    assert gate.buckets[0].plain.n == 0
    clock.now += 0.01
    gate.record(1, False, 1)
    assert gate.buckets[0].plain.value == pytest.approx(100)
    gate.reset()
    assert gate.buckets == {}


def test_an_off_bucket_leaves_its_rows_draft_state_behind_until_the_step_before_a_probe() -> None:
    """follows: the proposer takes a step's hidden states while the bucket drafts, and in an
    off bucket only on the plain steps right before a drafting probe."""
    e = Engine()
    e.run(g.FIRST_RUN + g.PROBE_STEPS, rows=1, draft_s=0.02, draft_tokens=1)
    wait = e.gate.buckets[0].left
    follows, steps = [], []
    for _ in range(wait + g.MIN_SAMPLES + 1):
        steps += e.run(1, rows=1, draft_s=0.02, draft_tokens=1)
        follows.append(e.gate.follows(1))   # (asked after the step, as settle does)
    # the probe ends once it has measured: drafting lost again, the next wait is twice as long
    assert steps == [False] * wait + [True] * g.MIN_SAMPLES + [False]
    # (the last two plain steps' states: the engine settles a pipelined step after it has
    # chosen the next one)
    assert follows == [False] * (wait - 2) + [True] * (g.MIN_SAMPLES + 1) + [False] * 2
    assert e.gate.follows(3)   # a bucket not met yet drafts


def test_two_steps_read_back_in_one_pass_count_as_what_they_took_together() -> None:
    """The engine reads a pipelined step and the sync step after it in one loop pass: one
    interval holds both steps' time, the next is near zero. Goodput is averaged tokens over
    averaged seconds, so the pair reads as two steps of half the time each (an average of
    per-step rates would read near infinity)."""
    e = Engine()
    gate, clock = e.gate, e.clock
    gate.record(1, False, 1)
    for _ in range(4):
        clock.now += 0.02
        gate.record(1, False, 1)
        clock.now += 0.00001
        gate.record(1, False, 1)
    assert 80 < gate.buckets[0].plain.value < 125   # (the moving average's phase)


def test_a_stall_counts_as_a_few_steps_not_as_its_length() -> None:
    e = Engine()
    gate, clock = e.gate, e.clock
    gate.record(1, False, 1)
    for gap in (0.01, 0.01, 0.01, 10.0):
        clock.now += gap
        gate.record(1, False, 1)
    plain = gate.buckets[0].plain
    assert plain.value == pytest.approx(1 / (0.01 + g.ALPHA * (g.CLIP - 1) * 0.01))


def test_a_new_larger_bucket_starts_off_where_a_smaller_one_lost() -> None:
    """Drafting lost at one row: a batch of 4-7 met later starts plain (and probes after the
    one-row bucket's wait, turning on if drafting wins there after all); 2-3, met before,
    decides alone."""
    e = Engine()
    e.run(2, rows=2, draft_s=0.015, draft_tokens=3)
    e.run(g.FIRST_RUN + g.PROBE_STEPS, rows=1, draft_s=0.02, draft_tokens=1)
    assert e.switches() == [("1", False)]
    steps = e.run(e.gate.buckets[0].wait, rows=5, draft_s=0.03, draft_tokens=1)
    assert not any(steps)
    assert [(r.label, r.like) for r in e.reports if r.like] == [("4-7", "1")]
    assert e.gate.buckets[1].on
    steps = e.run(20, rows=5, draft_s=0.005, draft_tokens=3)   # drafting wins at 4-7 after all
    assert steps[-10:] == [True] * 10 and e.switches()[-1] == ("4-7", True)
