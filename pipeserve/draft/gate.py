"""The measured draft gate (draft.gate): per batch-size bucket, the goodput of steps that verified
drafts and of plain decode steps (tokens emitted per second between consecutive step
completions, as moving averages); a bucket where drafting is slower decodes plainly, probing now
and then. The draft stage asks before each step and reports each completion. Engine thread; no
mlx import; the clock is passed in."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ALPHA = 0.25        # weight of a new step in the moving averages (the first 1/ALPHA: plain means)
CLIP = 4.0          # a step's seconds count at most this × the average (a stall is not the kind's)
MIN_SAMPLES = 3     # samples of each kind a bucket needs before it decides
FIRST_RUN = 3       # a new bucket's drafting steps before its first plain probe
ON_RUN = 128        # drafting steps between two plain probes while drafting wins
PROBE_STEPS = 4     # steps of a probe at most (the first plain one after a verify is not measured;
                    # a drafting probe ends once it has MIN_SAMPLES)
OFF_MIN = 64        # plain steps before a bucket gone off probes drafting, at least
PROBE_SHARE = 0.05  # ... and enough that a probe's drafting steps take at most this share of the
                    # wait's time (a drafting step may cost many plain ones)
OFF_MAX = 4096      # the longest wait between probes (it doubles while drafting keeps losing)
HYSTERESIS = 0.05   # a bucket that went off below `ratio` turns on again at ratio + this


@dataclass(slots=True)
class Rate:
    """Goodput of one kind of step: moving averages of its tokens and of its seconds, whose
    ratio is tokens per second (a ratio of sums: two completions read back in one loop pass,
    one interval long and one near zero, average to what the two steps took)."""

    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if self.n:
            seconds = min(seconds, CLIP * self.seconds)
        self.n += 1
        w = max(ALPHA, 1.0 / self.n)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    def reset(self) -> None:
        self.tokens, self.seconds, self.n = 0.0, 0.0, 0


@dataclass(slots=True)
class Bucket:
    """One batch-size bucket: its two rates, whether it drafts, and where it is in its runs (a
    run of the state's own kind of step, then a probe of the other kind, and so on)."""

    label: str
    draft: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    on: bool = True
    probing: bool = False
    left: int = FIRST_RUN   # steps left in the current run
    wait: int = OFF_MIN     # the next wait of the bucket while off

    @property
    def drafts(self) -> bool:
        """Whether this run's steps draft (the state's kind, or the other one while probing)."""
        return self.on != self.probing


@dataclass(frozen=True, slots=True)
class Report:
    """What the gate tells its owner about one bucket: when it first meets it, when it turns
    off or on (`switched`), and when a probe has measured (rates in tokens per second)."""

    label: str
    on: bool
    draft_rate: float
    plain_rate: float
    switched: bool = False
    like: str | None = None   # a new bucket that starts off as this smaller one is


def bucket_of(rows: int) -> int:
    """Decoding rows → bucket index: 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    return max(1, rows).bit_length() - 1


class DraftGate:
    """Whether a step of `rows` decoding rows drafts. `choose` once per step that could draft
    (it advances the bucket's runs), `next_drafts` right after it (the step before a drafting
    one must bring its tokens to the host), `record` at every step's completion, `pause` when
    the engine idles (the time between is not a step's). `report` hears of every bucket's first
    step, switches and measured probes."""

    def __init__(self, ratio: float = 0.95, clock: Callable[[], float] = time.perf_counter,
                 report: Callable[[Report], None] | None = None) -> None:
        self.ratio = ratio   # drafting stays on while its goodput >= ratio × the plain steps'
        self.clock = clock
        self.report = report
        self.buckets: dict[int, Bucket] = {}
        self._last: float | None = None     # the previous completion (None: after an idle)
        self._last_drafted = False          # whether the previous completed step verified drafts

    def _bucket(self, rows: int) -> Bucket:
        i = bucket_of(rows)
        b = self.buckets.get(i)
        if b is None:
            lo = 1 << i
            b = self.buckets[i] = Bucket(str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}")
            # drafting that lost with fewer rows loses with more (a verify's extra width costs
            # more, the forward it saves less, as the batch grows): start off, and probe
            smaller = [j for j, o in self.buckets.items() if j < i and not o.on]
            if smaller:
                b.on, b.wait = False, self.buckets[max(smaller)].wait
                b.left = b.wait
            self._tell(b, like=self.buckets[max(smaller)].label if smaller else None)
        return b

    def choose(self, rows: int) -> bool:
        """Whether this step of `rows` decoding rows drafts (counts the step in its run)."""
        b = self._bucket(rows)
        if b.left <= 0:
            self._next_run(b)
        b.left -= 1
        return b.drafts

    def next_drafts(self, rows: int) -> bool:
        """Whether the next step, if it has as many rows, drafts (does not advance)."""
        b = self._bucket(rows)
        return b.drafts if b.left > 0 else not b.drafts

    def follows(self, rows: int) -> bool:
        """Whether the proposer should keep up with a step of `rows` decoding rows (take its
        hidden states): the bucket is on (its plain probes too), or its drafting probe comes
        next. While a bucket is off its rows' draft state is left behind (every proposer starts
        over across a gap), so a probe after a long wait does not first catch up on every step
        since."""
        b = self.buckets.get(bucket_of(rows))
        return b is None or b.on or b.drafts or b.left <= 1

    def _next_run(self, b: Bucket) -> None:
        if b.probing:
            b.probing, b.left = False, ON_RUN if b.on else b.wait
            return
        b.probing, b.left = True, PROBE_STEPS
        (b.plain if b.on else b.draft).reset()   # a probe measures afresh

    def pause(self) -> None:
        """The engine idles: the next completion starts no interval."""
        self._last = None

    def reset(self) -> None:
        """Forget everything measured (after the kernel warm-up: its steps build kernels)."""
        self.buckets.clear()
        self._last = None

    def record(self, rows: int, drafted: bool | None, tokens: int) -> None:
        """A step completed: `tokens` emitted by `rows` decoding rows, `drafted` whether it
        verified proposed drafts (None: not a plain decode step — prompt chunks or forced
        tokens in it — so it only starts the next interval)."""
        now = self.clock()
        last, self._last = self._last, now
        after_draft, self._last_drafted = self._last_drafted, bool(drafted)
        if drafted is None or last is None or now <= last or rows <= 0:
            return
        if not drafted and after_draft:
            return   # the first plain step after a verify also pays the pipeline's restart
        b = self._bucket(rows)
        (b.draft if drafted else b.plain).add(tokens, now - last)
        if b.draft.n < MIN_SAMPLES or b.plain.n < MIN_SAMPLES:
            return
        if b.on:
            if b.draft.value < self.ratio * b.plain.value:
                b.on, b.probing = False, False
                b.wait = b.left = self._wait(b, OFF_MIN)
                self._tell(b, switched=True)
            elif not drafted and b.probing and b.plain.n == MIN_SAMPLES:
                self._tell(b)
        elif drafted and b.probing and b.draft.n >= MIN_SAMPLES:
            if b.draft.value >= (self.ratio + HYSTERESIS) * b.plain.value:
                b.on, b.probing, b.left, b.wait = True, False, ON_RUN, OFF_MIN
                self._tell(b, switched=True)
            else:
                b.wait = b.left = self._wait(b, 2 * b.wait)
                b.probing = False
                self._tell(b)

    @staticmethod
    def _wait(b: Bucket, steps: int) -> int:
        """Plain steps before the next probe: `steps`, or more where a drafting step costs so
        many plain ones that the probe would take over PROBE_SHARE of the time; bounded."""
        cost = b.draft.seconds / b.plain.seconds if b.plain.seconds > 0 else 1.0
        return min(OFF_MAX, max(steps, math.ceil(MIN_SAMPLES * cost / PROBE_SHARE)))

    def _tell(self, b: Bucket, switched: bool = False, like: str | None = None) -> None:
        if self.report is not None:
            self.report(Report(b.label, b.on, b.draft.value, b.plain.value, switched, like))
