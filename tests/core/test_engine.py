"""The engine on a real tiny model, without HTTP: sampling fields, aborts, FIFO order,
and that nothing is left running afterwards."""
from __future__ import annotations

import asyncio
import time

import pytest

from pipeserve.core.events import Abort, Flush
from pipeserve.core.scoring import Score
from pipeserve.errors import EngineUnavailable
from pipeserve.core.stream import RequestStream

PROMPT = [10, 20, 30, 40, 50, 60]


def test_logit_bias_forces_a_token(engine_factory) -> None:
    h = engine_factory()
    out = h.generate(PROMPT, max_tokens=6, logit_bias={77: 100.0})
    assert out["ids"] == [77] * 6
    assert out["finish"] == "length"


def test_greedy_logprobs_pick_the_top_token(engine_factory) -> None:
    h = engine_factory()
    out = h.generate(PROMPT, max_tokens=8, logprobs=True, top_logprobs=4)
    assert len(out["logprobs"]) == 8
    for token_id, lp in zip(out["ids"], out["logprobs"]):
        assert lp.token_id == token_id
        assert len(lp.top) == 4
        assert lp.top[0][0] == token_id and abs(lp.top[0][1] - lp.logprob) < 1e-5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0


def test_seed_streams_are_request_local(engine_factory) -> None:
    h = engine_factory()
    a = h.generate(PROMPT, max_tokens=24, temperature=1.0, seed=7)["ids"]
    b = h.generate(PROMPT, max_tokens=24, temperature=1.0, seed=7)["ids"]
    others = [h.generate(PROMPT, max_tokens=24, temperature=1.0, seed=s)["ids"] for s in (8, 9)]
    assert a == b
    assert any(o != a for o in others)


def test_repetition_penalty_changes_repeating_output(engine_factory) -> None:
    h = engine_factory()
    plain = h.generate(PROMPT, max_tokens=32)["ids"]
    penalised = h.generate(PROMPT, max_tokens=32, repetition_penalty=1.8,
                           penalty_context_size=32)["ids"]
    # Greedy random-weight output repeats tokens; a strong penalty must change the path
    # and reduce the repetition.
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_top_k_one_is_greedy_even_when_sampling(engine_factory) -> None:
    h = engine_factory()
    greedy = h.generate(PROMPT, max_tokens=16)["ids"]
    sampled = h.generate(PROMPT, max_tokens=16, temperature=1.5, top_k=1, seed=3)["ids"]
    assert sampled == greedy


def test_fifo_and_abort_free_the_engine(engine_factory) -> None:
    """A queued request aborted before it runs never starts; a running one stops at the next
    step; the request after them completes, and the engine ends with nothing in flight."""
    h = engine_factory()
    eos_off = {0: -100.0, 2: -100.0}

    async def scenario() -> tuple[list[str], dict]:
        loop = asyncio.get_running_loop()
        long_req = h.request(PROMPT, max_tokens=3000, logit_bias=eos_off)
        queued = h.request(PROMPT, max_tokens=3000, logit_bias=eos_off)
        s1, s2 = RequestStream(loop), RequestStream(loop)
        h.engine.submit(long_req, s1)
        h.engine.submit(queued, s2)
        first = await asyncio.wait_for(s1.next(), 30)   # the long one is running
        h.engine.abort(queued.request_id)
        h.engine.abort(long_req.request_id)
        finals = []
        for s in (s1, s2):
            event = await asyncio.wait_for(s.next(), 30)
            while not s.finished:
                event = await asyncio.wait_for(s.next(), 30)
            finals.append(event.reason.value)
        last = (await h.generate_many([h.request(PROMPT, max_tokens=4)]))[0]
        return finals, {"first": first, "last": last}

    finals, info = asyncio.run(scenario())
    assert finals == ["abort", "abort"]
    assert len(info["last"]["ids"]) == 4
    deadline = time.monotonic() + 10
    while h.engine.num_inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.engine.num_inflight == 0 and h.engine.num_waiting == 0
    assert not h.engine.scheduler.running and not h.engine.scheduler.waiting


def test_abort_of_unknown_request_is_harmless(engine_factory) -> None:
    h = engine_factory()
    h.engine._inbox.put(Abort("nobody"))
    assert len(h.generate(PROMPT, max_tokens=3)["ids"]) == 3


def test_buffer_cache_cap_is_applied_and_output_unchanged(engine_factory) -> None:
    """admission.buffer_cache_gb caps MLX's cache of freed buffers (the default does so on
    CUDA only): the engine sets it at load, and greedy output is what an uncapped engine gives."""
    import mlx.core as mx
    plain = engine_factory().generate(PROMPT, max_tokens=12)["ids"]
    before = mx.set_cache_limit(1 << 40)   # read the limit the plain engine left
    mx.set_cache_limit(before)
    h = engine_factory("admission.buffer_cache_gb=0.25")
    try:
        assert h.generate(PROMPT, max_tokens=12)["ids"] == plain
        assert mx.set_cache_limit(before) == 250_000_000
    finally:
        mx.set_cache_limit(before)


def test_a_command_is_answered_through_its_future(engine_factory) -> None:
    """command() is the one way to ask the engine thread for a result: a prompt's logprobs
    and a flush come back on the future; a stopped engine answers a command at once with a
    503 instead of leaving its caller waiting."""
    h = engine_factory()
    scored = h.engine.command(Score(PROMPT, 2)).result(60)
    assert scored[0] is None and [t.token_id for t in scored[1:]] == PROMPT[1:]
    assert all(t.logprob <= 0 and len(t.top) == 2 for t in scored[1:])
    assert h.engine.command(Flush()).result(60) is True
    h.close()
    late = h.engine.command(Score(PROMPT, 0))
    assert late.done()
    with pytest.raises(EngineUnavailable, match="engine is stopped"):
        late.result(0)


def test_an_abandoned_engine_calls_on_death_once(engine_factory) -> None:
    """abandon (a distributed rank is gone: the engine thread is stuck for good) takes the path
    of a loop that died: the engine is dead, refuses work with a 503, and calls on_death (the
    server's exit, http/drain.py) once, however often it is told after. Abandoned while idle:
    a live engine thread would race the failing of its rows."""
    h = engine_factory()
    deaths: list[str] = []
    h.engine.on_death = lambda: deaths.append("died")
    h.engine.abandon(RuntimeError("rank 1 is gone"))
    h.engine.abandon(RuntimeError("rank 1 is gone"))
    assert deaths == ["died"] and h.engine.state.value == "dead"
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(EngineUnavailable, match="engine is dead"):
            h.engine.submit(h.request(PROMPT, max_tokens=3), RequestStream(loop))
    finally:
        loop.close()
