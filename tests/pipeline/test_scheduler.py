"""SerialScheduler decisions, without a model: chunking, one-ahead decode, stops, aborts."""
from __future__ import annotations

from pipeline.request import FinishReason, PromptInput, Request, RequestStatus, SamplingParams
from pipeline.scheduler import SerialScheduler, StepResult
from tests.conftest import make_config


def req(n_prompt: int, max_tokens: int, rid: str = "r") -> Request:
    return Request(request_id=rid, endpoint="test", inputs=PromptInput(token_ids=[1] * n_prompt),
                   prompt_ids=list(range(1, n_prompt + 1)),
                   sampling=SamplingParams(max_tokens=max_tokens), stop_token_ids=frozenset({0}))


def sched(chunk: int = 4) -> SerialScheduler:
    return SerialScheduler(make_config(f"scheduler.prefill_chunk={chunk}"))


def step(s: SerialScheduler, token: int):
    batch = s.schedule()
    assert batch is not None
    rows = [i for i, r in enumerate(batch.requests) if r.num_computed_tokens >= r.num_prompt_tokens]
    batch.sample_rows = rows
    return batch, list(s.update(batch, StepResult.single([token] * len(rows), None, None)))


def test_prompt_is_chunked_then_decoded_one_token_per_step() -> None:
    s = sched(chunk=4)
    r = req(10, 3)
    s.add(r)
    counts = []
    for _ in range(4):
        b = s.schedule()
        counts.append(b.num_new_tokens[0])
    assert counts == [4, 4, 1, 1]         # 9 prompt tokens in chunks, then the last one decodes
    assert r.num_computed_tokens == 10 and r.num_scheduled_outputs == 1


def test_length_finish_and_no_overscheduling() -> None:
    s = sched()
    r = req(2, 2)
    s.add(r)
    s.schedule()                          # prefill token 1
    b1 = s.schedule()                     # decode 1
    b2 = s.schedule()                     # decode 2 queued one ahead
    assert s.schedule() is None           # max_tokens reached: nothing more to schedule
    for b in (b1, b2):
        b.sample_rows = [0]
    events = list(s.update(b1, StepResult.single([7], None, None))) + list(s.update(b2, StepResult.single([8], None, None)))
    assert r.output_ids == [7, 8] and r.finish_reason is FinishReason.LENGTH
    assert not s.has_work()
    assert [type(e).__name__ for _, e in events] == ["TokenDelta", "TokenDelta", "Finished"]


def test_stop_token_finishes_and_in_flight_result_is_discarded() -> None:
    s = sched()
    r = req(1, 10)
    s.add(r)
    b1 = s.schedule()
    b2 = s.schedule()                     # queued before b1's result is known
    b1.sample_rows = b2.sample_rows = [0]
    events = list(s.update(b1, StepResult.single([0], None, None)))   # EOS
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.STOP
    assert list(s.update(b2, StepResult.single([5], None, None))) == []
    assert r.output_ids == [] and r.cache is None
    assert type(events[0][1]).__name__ == "Finished"


def test_fifo_order_and_abort_of_waiting_request() -> None:
    s = sched()
    a, b, c = req(1, 1, "a"), req(1, 1, "b"), req(1, 1, "c")
    for r in (a, b, c):
        s.add(r)
    assert s.abort("b") is b and b.finish_reason is FinishReason.ABORT
    batch = s.schedule()
    assert batch.requests == [a]
    batch.sample_rows = [0]
    list(s.update(batch, StepResult.single([3], None, None)))
    assert s.schedule().requests == [c]
    assert s.abort("zzz") is None
