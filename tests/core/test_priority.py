"""Priority and the latency estimate, without a model: the scheduler's queue takes urgent
requests first (FIFO within a priority), a request waiting past scheduler.max_wait_s goes
ahead of every priority, the prompt budget goes to the most urgent prefill; the estimator
turns measured rates into queue / prefill / decode time; `priority` values are checked."""
from __future__ import annotations

import math
import time

import pytest

from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.latency import LatencyEstimator, priority_of
from tests.core.test_scheduler import req, sched

CLASSES = {"interactive": 0, "default": 5, "batch": 9}


def queued(priority: int, rid: str, n_prompt: int = 8) -> object:
    r = req(n_prompt, 4, rid)
    r.priority = priority
    return r


def test_urgent_first_fifo_within_a_priority() -> None:
    s = sched("scheduler=serial")
    for p, rid in [(9, "b1"), (5, "d1"), (0, "i1"), (9, "b2"), (0, "i2"), (5, "d2")]:
        s.add(queued(p, rid))
    assert [r.request_id for r in s.waiting] == ["i1", "i2", "d1", "d2", "b1", "b2"]


def test_a_starved_request_goes_first_after_max_wait_s() -> None:
    s = sched("scheduler=serial", "scheduler.max_wait_s=0.5")
    for rid in ("batch-old-1", "batch-old-2"):
        old = queued(9, rid)
        old.arrival_s = time.perf_counter() - 1.0   # has waited past max_wait_s
        s.add(old)
    for i in range(3):
        s.add(queued(0, f"urgent-{i}"))
    assert s.waiting[0].request_id == "urgent-0"   # before aging: strict priority
    s.schedule()
    assert [r.request_id for r in s.running] == ["batch-old-1"]
    s.add(queued(0, "urgent-late"))   # an aged request is overtaken by nothing
    assert [r.request_id for r in s.waiting] == [
        "batch-old-2", "urgent-0", "urgent-1", "urgent-2", "urgent-late"]


def test_strict_priority_without_max_wait() -> None:
    s = sched("scheduler=serial", "scheduler.max_wait_s=null")
    old = queued(9, "batch-old")
    old.arrival_s = time.perf_counter() - 3600
    s.add(old)
    s.add(queued(0, "urgent"))
    s.schedule()
    assert [r.request_id for r in s.running] == ["urgent"]


def test_prompt_budget_goes_to_the_most_urgent_prefill() -> None:
    s = sched("scheduler=continuous", "scheduler.max_batch=4",
              "scheduler.max_num_batched_tokens=64", "scheduler.prefill_chunk=64")
    s.add(queued(9, "batch", n_prompt=200))
    s.add(queued(0, "urgent", n_prompt=200))
    plan = s.schedule()
    assert [r.request_id for r in plan.rows] == ["urgent"]   # the whole budget, urgent first


def test_priority_values_and_classes() -> None:
    assert priority_of(None, CLASSES, "default") == (5, "default")
    assert priority_of("batch", CLASSES, "default") == (9, "batch")
    assert priority_of(0, CLASSES, "default") == (0, "interactive")
    assert priority_of(3, CLASSES, "default") == (3, "3")
    for bad in (10, -1, "urgent", True, 1.5):
        with pytest.raises(InvalidRequest, match="priority is .*allowed: an integer 0"):
            priority_of(bad, CLASSES, "default")


def test_estimate_from_measured_rates() -> None:
    est = LatencyEstimator()
    assert est.estimate(100, 100, slots=1) is None and est.retry_after_s(1) == 1
    est.admit("a", None)
    # 8-token prompt: first token 10 ms after its row; 99 tokens in 1 s; held 1.01 s
    est.finish("a", 8, 100, prefill_s=0.01, decode_s=1.0, queue_s=0.0, e2e_s=1.01)
    est.admit("b", None)
    # a 1000-token prompt in 0.51 s: 0.5 s past the 10 ms overhead → 2000 tokens a second
    est.finish("b", 1000, 100, prefill_s=0.51, decode_s=1.0, queue_s=0.0, e2e_s=1.51)
    e = est.estimate(2000, 198, slots=1)
    assert e is not None and e.queue_s == 0
    assert e.prefill_s == pytest.approx(0.01 + 2000 / est.prefill_tps)
    assert e.decode_s == pytest.approx(2.0)
    est.admit("c", e)   # one running: the next waits for it, as long as its estimate says
    behind = est.estimate(10, 10, slots=1)
    assert behind is not None and behind.queue_s == pytest.approx(e.prefill_s + e.decode_s)
    assert behind.queue_s > 2 * est.request_s   # not a typical request's time
    assert est.retry_after_s(1) == math.ceil(behind.queue_s)   # Retry-After: the wait
    est.admit("d", behind)   # two ahead: their estimates add up
    assert est.estimate(10, 10, slots=1).queue_s == pytest.approx(
        e.prefill_s + e.decode_s + behind.prefill_s + behind.decode_s)
    assert est.estimate(10, 10, slots=4).queue_s == 0   # a row is free
    est.forget("d")
    ratio = est.finish("c", 2000, 198, prefill_s=1.0, decode_s=2.0, queue_s=0.0,
                       e2e_s=e.total_s * 1.5)
    assert ratio == pytest.approx(1.5)


def test_aged_requests_go_in_arrival_order_whatever_their_priority() -> None:
    s = sched("scheduler=serial", "scheduler.max_wait_s=0.5")
    now = time.perf_counter()
    for rid, p, age in [("batch", 9, 3.0), ("urgent-a", 0, 2.0), ("urgent-b", 0, 1.0)]:
        r = queued(p, rid)
        r.arrival_s = now - age
        s.add(r)
    s.add(queued(0, "fresh"))
    s.schedule()
    assert [r.request_id for r in s.running] == ["batch"]
    assert [r.request_id for r in s.waiting] == ["urgent-a", "urgent-b", "fresh"]


def test_priority_and_checkpoints_cross_a_distributed_group_and_aging_is_off() -> None:
    from pipeserve.distributed import wire
    r = queued(0, "r", n_prompt=12)
    r.checkpoints_at = (7,)
    back = wire.decode_request(wire.encode_request(r))
    assert back.priority == 0 and back.checkpoints_at == (7,)
    s = sched("scheduler=serial", "scheduler.max_wait_s=0.5", "distributed=tensor")
    old = queued(9, "batch-old")
    old.arrival_s = time.perf_counter() - 10   # would have aged: ranks' clocks differ
    s.add(old)
    s.add(queued(0, "urgent"))
    s.schedule()
    assert [x.request_id for x in s.running] == ["urgent"]
