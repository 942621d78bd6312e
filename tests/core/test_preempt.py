"""Preemption: with every row taken, a waiting request of a more urgent class takes the row of
the least urgent preemptible one, which is evicted (its KV to the prompt cache), waits again
ahead of its class with its output folded into its prompt, and reports the client's counts at
its end; what is not preemptible keeps its row. Without a model (the scheduler alone), then on
a real engine: a greedy batch row preempted by an interactive one gives the output it gives
alone, with a prompt cache and without one."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeserve.core.events import Finished, TokenDelta
from pipeserve.core.stream import RequestStream
from pipeserve.core.scheduler import finished_event
from pipeserve.grammar.constraint import Constraint, ConstraintKind
from pipeserve.core.scheduler import Limits
from pipeserve.request import FinishReason, RequestStatus
from tests.core.test_scheduler import memory, output, req, sched


def running(s: Any, priority: int, rid: str, outputs: int) -> Any:
    """A row admitted and decoding, `outputs` tokens out."""
    r = req(8, 20, rid)
    r.priority = priority
    s.add(r)
    for _ in range(outputs + 1):   # a prefill step, then a token a step
        list(s.update(plan := s.schedule(), output(plan)))
    assert r in s.running and len(r.output_ids) == outputs
    return r


def test_an_urgent_request_takes_a_batch_row() -> None:
    s = sched("scheduler=continuous", "scheduler.max_batch=1")
    evicted: list[str] = []
    s.evict = lambda r: evicted.append(r.request_id)
    batch = running(s, 9, "batch", 3)
    urgent = req(8, 4, "urgent")
    urgent.priority = 0
    s.add(urgent)
    s.schedule()
    assert evicted == ["batch"] and [r.request_id for r in s.running] == ["urgent"]
    assert [r.request_id for r in s.waiting] == ["batch"] and s.preempted == [batch]
    assert batch.prompt_ids == list(range(1, 9)) + [5] * 3 and batch.output_ids == []
    assert batch.sampling.max_tokens == 17 and batch.num_computed_tokens == 0
    batch.output_ids = [5, 5]
    batch.finish_reason = FinishReason.LENGTH
    event = finished_event(batch)   # as the client sent and saw it
    assert (event.num_prompt_tokens, event.num_output_tokens) == (8, 5)
    assert event.extras["preemptions"] == 1


def test_an_urgent_request_takes_the_kv_budget_a_batch_row_holds() -> None:
    """Rows are free but the KV budget is not: the head takes what batch rows reserved, as
    many as it needs, and no more; a row of a class not preemptible keeps its KV."""
    s = sched("scheduler=continuous", "scheduler.max_batch=8")
    s.configure(Limits(8, 512, 512), memory(kv_bytes_per_token=1), kv_budget=100)
    evicted: list[str] = []
    s.evict = lambda r: evicted.append(r.request_id)
    default = running(s, 5, "default", 1)        # 8 + 20 bytes each
    batch = [running(s, 9, f"b{i}", 1) for i in range(2)]
    assert s.kv_reserved == 84
    urgent = req(25, 25, "urgent")               # 50 bytes: one batch row's 28 is not enough
    urgent.priority = 0
    s.add(urgent)
    s.schedule()
    assert evicted == ["b1", "b0"] and s.kv_reserved == 28 + 50   # the latest admitted first
    assert [r.request_id for r in s.running] == ["default", "urgent"]
    assert [r.request_id for r in s.waiting] == ["b0", "b1"]   # in their first order again
    assert default.status is RequestStatus.RUNNING and batch[0].preemptions == 1


def test_what_keeps_its_row() -> None:
    s = sched("scheduler=continuous", "scheduler.max_batch=1")
    s.evict = lambda r: None
    default = running(s, 5, "default", 1)
    for priority in (0, 5):   # default is not preemptible: not even for interactive
        other = req(8, 4, f"p{priority}")
        other.priority = priority
        s.add(other)
        s.schedule()
        assert s.running == [default]
    s = sched("scheduler=continuous", "scheduler.max_batch=1")
    s.evict = lambda r: None
    batch = running(s, 9, "batch", 1)
    batch.constraint = Constraint(ConstraintKind.JSON_OBJECT, "", "response_format")
    urgent = req(8, 4, "urgent")
    urgent.priority = 0
    s.add(urgent)
    s.schedule()
    assert s.running == [batch]   # its grammar follows its output: it keeps the row
    s = sched("scheduler=continuous", "scheduler.max_batch=1", "admission.preemptible=[]")
    s.evict = lambda r: None
    batch = running(s, 9, "batch", 1)
    s.add(urgent)
    s.schedule()
    assert s.running == [batch]


NO_EOS = {0: -100.0, 2: -100.0}


async def preempted(h: Any, prompt: list[int], tokens: int,
                    **sampling: Any) -> tuple[list[int], Finished]:
    """A batch request runs alone until it has output; an interactive one then comes and
    takes its row (max_batch 1). The batch's ids and its Finished event."""
    loop = asyncio.get_running_loop()
    batch = h.request(prompt, max_tokens=tokens, logit_bias=NO_EOS, **sampling)
    batch.priority = 9
    urgent = h.request(prompt[:5], max_tokens=4, logit_bias=NO_EOS)
    urgent.priority = 0
    mine, theirs = RequestStream(loop), RequestStream(loop)
    h.engine.submit(batch, mine)
    ids: list[int] = []
    while True:
        event = await mine.next()
        if isinstance(event, Finished):
            break
        assert isinstance(event, TokenDelta), event
        if len(ids) < 4 <= len(ids) + len(event.token_ids):
            h.engine.submit(urgent, theirs)
        ids += event.token_ids
    while not isinstance(await theirs.next(), Finished):
        pass
    return ids, event


def hit_tokens(h: Any) -> float:
    return sum(x.value for m in h.metrics.cache_hit_tokens.collect() for x in m.samples
               if x.name.endswith("_total"))


@pytest.mark.parametrize("cache, sampling", [("ram", {}), ("off", {}),
                                             ("ram", {"temperature": 0.9, "seed": 11})],
                         ids=["greedy-ram", "greedy-off", "seeded-ram"])
def test_a_preempted_row_equals_its_solo_run(engine_factory: Any, cache: str,
                                             sampling: dict[str, Any]) -> None:
    """Greedy, and seeded sampling: its sampler stream goes on where it stopped."""
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=1", f"cache={cache}")
    prompt = list(range(10, 40))
    solo = h.generate(prompt, max_tokens=48, logit_bias=NO_EOS, **sampling)
    before = hit_tokens(h)
    ids, done = asyncio.run(asyncio.wait_for(preempted(h, prompt, 48, **sampling), 120))
    assert done.extras.get("preemptions", 0) >= 1
    if cache == "ram":   # its prompt from the solo run, then prompt + output at readmission
        assert hit_tokens(h) - before >= (len(prompt) - 1) + (len(prompt) + 4 - 1)
    assert ids == solo["ids"] and done.num_output_tokens == 48
    assert done.num_prompt_tokens == len(prompt)
    assert h.metrics.preemptions._value.get() >= 1
