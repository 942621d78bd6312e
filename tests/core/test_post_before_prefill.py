"""A step whose plan carries prompt chunks evaluates them inside its launch. The step still in
flight is read and its tokens posted before that launch, so decoding rows' tokens and
first tokens do not wait for someone else's prompt chunk. The rows it ended keep their KV until
after the launch: the plan was made with them. Tokens equal each row's alone."""
from __future__ import annotations

import asyncio
from typing import Any

from pipeserve.core.stream import RequestStream
from tests.core.test_batching import EOS_OFF, PROMPTS, solo, wait_idle

LONG = [30 + (i * 11) % 400 for i in range(70)]   # 3 chunks of 32, joining mid-decode


def _record(h) -> list[tuple[str, int, bool]]:
    """(launch | read, the launched step's id, whether its plan has prompt chunks)."""
    step, seen = h.engine.step, []
    launch, read = step.launch, step.read

    def launched(plan: Any) -> Any:
        out = launch(plan)
        seen.append(("launch", id(out), bool(plan.prefill)))
        return out

    def was_read(out: Any) -> Any:
        seen.append(("read", id(out), bool(out.plan.prefill)))
        return read(out)
    step.launch, step.read = launched, was_read
    return seen


def test_the_step_in_flight_posts_before_a_prompt_chunks_launch(engine_factory) -> None:
    h = engine_factory("scheduler.prefill_chunk=32", "scheduler.max_batch=8", "cache=off")
    want_a = solo(h, PROMPTS[1], max_tokens=40, logit_bias=EOS_OFF)
    want_b = solo(h, LONG, max_tokens=6, logit_bias=EOS_OFF)
    want_c = solo(h, PROMPTS[4], max_tokens=3, logit_bias=EOS_OFF)
    seen = _record(h)

    async def go() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        a = h.request(PROMPTS[1], max_tokens=40, logit_bias=EOS_OFF)
        sa = RequestStream(loop)
        h.engine.submit(a, sa)
        got_a: list[int] = []
        while len(got_a) < 4:   # a decodes, pipelined
            got_a += getattr(await asyncio.wait_for(sa.next(), 60), "token_ids", [])
        # b's prompt takes three chunk steps while a decodes; c finishes during them
        others = asyncio.ensure_future(h.generate_many([
            h.request(LONG, max_tokens=6, logit_bias=EOS_OFF),
            h.request(PROMPTS[4], max_tokens=3, logit_bias=EOS_OFF)]))
        while not sa.finished:
            got_a += getattr(await asyncio.wait_for(sa.next(), 60), "token_ids", [])
        done = await others
        return [got_a, done[0]["ids"], done[1]["ids"]]
    got = asyncio.run(go())
    assert got == [want_a, want_b, want_c]
    chunk_launches = 0
    unread: set[int] = set()
    for kind, sid, chunks in seen:
        if kind == "launch":
            if chunks:
                chunk_launches += 1
                assert not unread, "a prompt chunk launched while a step's tokens waited"
            unread.add(sid)
        else:
            unread.discard(sid)
    assert chunk_launches >= 3   # b's chunks ran beside a's decoding
    wait_idle(h)


def test_an_idle_engine_takes_a_burst_whole(engine_factory) -> None:
    """scheduler.arrival_gap_ms: an idle engine woken by a request keeps taking arrivals until
    the gap passes without one, so requests sent a moment apart share their first prompt step;
    tokens equal each row's alone. (The gap here is generous: a loaded machine's stalls stay
    inside it.)"""
    h = engine_factory("scheduler.max_batch=8", "cache=off", "scheduler.arrival_gap_ms=1000",
                       "scheduler.arrival_window_ms=5000")
    prompts = [PROMPTS[1], LONG[:40], PROMPTS[3], PROMPTS[5]]
    want = [solo(h, p, max_tokens=5, logit_bias=EOS_OFF) for p in prompts]
    step, planned = h.engine.step, []
    launch = step.launch

    def launched(plan: Any) -> Any:
        planned.append(len(plan.prefill))
        return launch(plan)
    step.launch = launched

    async def go() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        reqs = [h.request(p, max_tokens=5, logit_bias=EOS_OFF) for p in prompts]
        streams = [RequestStream(loop) for _ in reqs]
        h.engine.submit(reqs[0], streams[0])
        await asyncio.sleep(0.05)   # the engine is awake and waiting out the gap
        for r, st in zip(reqs[1:], streams[1:]):
            h.engine.submit(r, st)
        got = []
        for st in streams:
            ids: list[int] = []
            while not st.finished:
                ids += getattr(await asyncio.wait_for(st.next(), 60), "token_ids", [])
            got.append(ids)
        return got
    assert asyncio.run(go()) == want
    assert planned[0] == len(prompts)   # every prompt in the first step
    wait_idle(h)
