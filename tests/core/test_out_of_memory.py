"""A step that runs out of device memory (MLX raises CUDA's or Metal's allocator error as a
RuntimeError) costs no request: its rows wait again with their output so far folded into their
prompt and are computed again, so every client gets the output of an engine that never failed;
the prompt cache is emptied, MLX's cached buffers given back and the memory gate's ceiling
lowered. A row that runs out again fails with a retryable error, so nothing loops. The fault is
injected by a sample stage from this module (the documented stage slot); the model and engine
are real."""
from __future__ import annotations

from collections.abc import Sequence
import logging
import re

import pytest

from pipeserve.config import ServeConfig
from pipeserve.core.plan import Logits, Sampled
from pipeserve.core.stage import StageDeps
from pipeserve.errors import EngineUnavailable
from pipeserve.request import Request

HERE = "tests.core.test_out_of_memory"
PROMPTS = [[11, 12, 13, 14, 15], [40 + i for i in range(37)], [7, 8, 9] * 5]
CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


class OutOfMemoryAt:
    """The built-in sampler, except that the `AT`-th step it samples for two rows or more
    (and every such step after it when `EVERY`) fails as an out-of-memory device does."""
    AT, EVERY = 3, False

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        from pipeserve.stages.sample import Sample
        self.inner = Sample(cfg, deps)
        self.batched = 0
        self.raised = 0

    def __getattr__(self, name: str):   # what else other stages ask of the sampler
        return getattr(self.inner, name)

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled:
        if len(rows) >= 2:
            self.batched += 1
            if self.batched == self.AT or (self.EVERY and self.batched > self.AT):
                self.raised += 1
                raise RuntimeError(CUDA_OOM)
        return self.inner(logits, rows)


class OutOfMemoryAlways(OutOfMemoryAt):
    AT, EVERY = 1, True


class OutOfMemoryThrice(OutOfMemoryAt):
    """The first three batched steps fail, as a card does while the gate's ceiling is still
    above what it holds; the fourth, with the ceiling lowered three times, fits."""
    AT, EVERY = 1, True

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled:
        if len(rows) >= 2 and self.raised >= 3:
            return self.inner(logits, rows)
        return super().__call__(logits, rows)


def test_a_step_out_of_memory_loses_no_request(engine_factory, caplog) -> None:
    plain = engine_factory()
    want = [plain.generate(p, max_tokens=12)["ids"] for p in PROMPTS]
    h = engine_factory(f"pipeline.sample._target_={HERE}.OutOfMemoryAt",
                       "scheduler.arrival_gap_ms=100", "scheduler.arrival_window_ms=2000")
    warm = h.generate([5, 6, 7, 8], max_tokens=4)   # an entry for the prompt cache
    ceiling = h.engine.scheduler.memory_ceiling
    caplog.set_level(logging.WARNING, logger="pipeserve")
    import asyncio
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=12) for p in PROMPTS]))
    assert h.engine.step.sample.raised == 1
    assert [g["ids"] for g in got] == want   # streams went on as if nothing had failed
    assert all(g["finish"] == "length" for g in got) and warm["finish"] == "length"
    line = next(r.getMessage() for r in caplog.records if "ran out of device memory" in
                r.getMessage())
    rows, again = map(int, re.search(r"with (\d+) row\(s\): (\d+) wait again", line).groups())
    assert rows == again >= 2 and "entries dropped" in line
    assert h.metrics.preemptions._value.get() == again
    if ceiling is not None:
        assert h.engine.scheduler.memory_ceiling == int(ceiling * 0.85)
    assert h.engine.state.value == "ready" and h.engine.step.kv.num_rows == 0
    assert h.generate(PROMPTS[1], max_tokens=12)["ids"] == want[1]


def test_rows_out_of_memory_three_times_in_a_row_still_finish(engine_factory) -> None:
    """An 80 GB card ran a burst out of memory twice in a row (round 10): the second time
    must not fail the rows; each failure lowers the ceiling again, until a step fits."""
    plain = engine_factory()
    want = [plain.generate(p, max_tokens=10)["ids"] for p in PROMPTS]
    h = engine_factory(f"pipeline.sample._target_={HERE}.OutOfMemoryThrice",
                       "scheduler.arrival_gap_ms=100", "scheduler.arrival_window_ms=2000")
    ceiling = h.engine.scheduler.memory_ceiling
    import asyncio
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=10) for p in PROMPTS]))
    assert h.engine.step.sample.raised == 3
    assert [g["ids"] for g in got] == want and all(g["extras"]["preemptions"] >= 3 for g in got)
    if ceiling is not None:
        assert h.engine.scheduler.memory_ceiling == int(int(int(ceiling * 0.85) * 0.85) * 0.85)
    assert h.engine._oom_retried == {} and h.engine.step.kv.num_rows == 0


def test_a_row_out_of_memory_past_its_retries_fails_and_the_engine_goes_on(engine_factory) -> None:
    h = engine_factory(f"pipeline.sample._target_={HERE}.OutOfMemoryAlways",
                       "scheduler.arrival_gap_ms=100", "scheduler.arrival_window_ms=2000")
    import asyncio
    with pytest.raises(EngineUnavailable, match="step .* failed"):
        asyncio.run(h.generate_many([h.request(p, max_tokens=6) for p in PROMPTS[:2]]))
    assert h.engine.step.sample.raised == 4   # once, then three more after waiting again
    assert h.engine.scheduler.running == [] and h.engine.step.kv.num_rows == 0
    assert h.generate(PROMPTS[0], max_tokens=6)["finish"] == "length"   # a lone row samples


class OutOfMemoryAlone(OutOfMemoryAt):
    """Every step fails, one row or many."""

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled:
        self.raised += 1
        raise RuntimeError(CUDA_OOM)


def test_a_row_out_of_memory_alone_a_second_time_fails_at_once(engine_factory) -> None:
    """A lone row waits again once (the prompt cache and MLX's buffers are freed for it); out
    of memory alone again, no smaller step can hold it: it fails without using its retries."""
    h = engine_factory(f"pipeline.sample._target_={HERE}.OutOfMemoryAlone")
    import asyncio
    with pytest.raises(EngineUnavailable, match="step .* failed"):
        asyncio.run(h.generate_many([h.request(PROMPTS[0], max_tokens=6)]))
    assert h.engine.step.sample.raised == 2
    assert h.engine._oom_retried == {} and h.engine.step.kv.num_rows == 0
