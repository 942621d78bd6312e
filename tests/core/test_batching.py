"""Continuous batching on real tiny float32 models: batched rows produce what they produce
alone, B=1 matches scheduler=serial, rows join/leave/cancel mid-flight, and nothing leaks."""
from __future__ import annotations

import asyncio
import time

import pytest

from pipeserve.core.stream import RequestStream

EOS_OFF = {0: -100.0, 2: -100.0}
PROMPTS = [[11, 12, 13], [40 + i for i in range(37)], [7], [100 + (i * 7) % 300 for i in range(90)],
           [3, 1, 4, 1, 5, 9, 2, 6], [200 + i for i in range(20)]]
LENGTHS = [20, 7, 33, 12, 25, 16]   # rows finish at different steps


def solo(h, prompt, **kw):
    return h.generate(prompt, **kw)["ids"]


def wait_idle(h, timeout_s: float = 10) -> None:
    """The engine's own accounting: nothing in flight, queued, running, or holding KV."""
    kv = h.engine.step.kv   # the row store: every row's KV, whatever its phase
    deadline = time.monotonic() + timeout_s
    while ((h.engine.num_inflight or h.engine.scheduler.running or kv.num_rows)
           and time.monotonic() < deadline):
        time.sleep(0.02)
    assert h.engine.num_inflight == 0 and not h.engine.scheduler.running
    assert not h.engine.scheduler.waiting
    assert kv.num_rows == 0 and kv.decode_rows == [] and kv.nbytes == 0


@pytest.mark.parametrize("model", ["tiny", "llama", "gemma", "hybrid"])
def test_batched_greedy_equals_solo(engine_factory, model: str) -> None:
    serial = engine_factory(f"model={model}", "scheduler=serial")
    expected = [solo(serial, p, max_tokens=n, logit_bias=EOS_OFF) for p, n in zip(PROMPTS, LENGTHS)]
    batched = engine_factory(f"model={model}", "scheduler=continuous", "scheduler.max_batch=8")
    reqs = [batched.request(p, max_tokens=n, logit_bias=EOS_OFF) for p, n in zip(PROMPTS, LENGTHS)]
    got = asyncio.run(batched.generate_many(reqs))
    assert [g["ids"] for g in got] == expected
    assert batched.metrics.batch_size._sum.get() > len(PROMPTS) * 2   # really ran batched
    wait_idle(batched)


def test_batch_of_one_equals_serial(engine_factory) -> None:
    serial = engine_factory("scheduler=serial")
    cont = engine_factory("scheduler=continuous")
    for p, n in zip(PROMPTS, LENGTHS):
        assert solo(cont, p, max_tokens=n) == solo(serial, p, max_tokens=n)


def test_rows_join_during_a_chunked_prefill_and_under_max_batch(engine_factory) -> None:
    """A long prompt prefilled 16 tokens per step while others decode; max_batch=3 caps the
    rows, so later requests wait and join as rows leave."""
    serial = engine_factory("scheduler=serial", "scheduler.prefill_chunk=16")
    expected = [solo(serial, p, max_tokens=n, logit_bias=EOS_OFF) for p, n in zip(PROMPTS, LENGTHS)]
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=3",
                       "scheduler.prefill_chunk=16")
    reqs = [h.request(p, max_tokens=n, logit_bias=EOS_OFF) for p, n in zip(PROMPTS, LENGTHS)]
    got = asyncio.run(h.generate_many(reqs))
    assert [g["ids"] for g in got] == expected
    wait_idle(h)


def test_mixed_sampling_settings_share_a_batch(engine_factory) -> None:
    serial = engine_factory("scheduler=serial")
    settings = [dict(max_tokens=16),
                dict(max_tokens=16, temperature=0.9, top_p=0.8, seed=11),
                dict(max_tokens=16, temperature=1.2, top_k=5, seed=5, repetition_penalty=1.3),
                dict(max_tokens=16, logprobs=True, top_logprobs=3),
                dict(max_tokens=16, presence_penalty=1.0, frequency_penalty=0.5, min_p=0.05,
                     temperature=0.7, seed=99)]
    prompts = PROMPTS[:len(settings)]
    expected = [serial.generate(p, logit_bias=EOS_OFF, **kw) for p, kw in zip(prompts, settings)]
    h = engine_factory("scheduler=continuous")
    got = asyncio.run(h.generate_many(
        [h.request(p, logit_bias=EOS_OFF, **kw) for p, kw in zip(prompts, settings)]))
    assert [g["ids"] for g in got] == [e["ids"] for e in expected]
    lp_got, lp_exp = got[3]["logprobs"], expected[3]["logprobs"]
    assert [x.token_id for x in lp_got] == [x.token_id for x in lp_exp]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lp_got, lp_exp))
    assert all(len(x.top) == 3 for x in lp_got)


def test_cancel_mid_prefill_and_mid_decode_leaves_others_intact(engine_factory) -> None:
    h = engine_factory("scheduler=continuous", "scheduler.prefill_chunk=16")
    long_prompt = [20 + (i % 400) for i in range(1500)]   # ~94 prefill chunks

    async def scenario() -> tuple[dict, list[str], list]:
        loop = asyncio.get_running_loop()
        keeper = h.request(PROMPTS[1], max_tokens=40, logit_bias=EOS_OFF)
        decoding = h.request(PROMPTS[0], max_tokens=3000, logit_bias=EOS_OFF)
        prefilling = h.request(long_prompt, max_tokens=5)
        streams = {r.request_id: RequestStream(loop) for r in (keeper, decoding, prefilling)}
        for r in (decoding, prefilling, keeper):
            h.engine.submit(r, streams[r.request_id])
        await asyncio.wait_for(streams[decoding.request_id].next(), 30)  # decoding for sure
        h.engine.abort(prefilling.request_id)
        h.engine.abort(decoding.request_id)
        ends = []
        for r in (decoding, prefilling):
            s = streams[r.request_id]
            while not s.finished:
                event = await asyncio.wait_for(s.next(), 30)
            ends.append(event.reason.value)
        ids = []
        s = streams[keeper.request_id]
        while not s.finished:
            event = await asyncio.wait_for(s.next(), 60)
            ids.extend(getattr(event, "token_ids", []))
        return {"keeper": ids}, ends, [prefilling]

    out, ends, (prefilling,) = asyncio.run(scenario())
    assert ends == ["abort", "abort"]
    assert prefilling.num_computed_tokens < len(prefilling.prompt_ids) - 1   # stopped mid-prefill
    assert prefilling.request_id not in h.engine.step.kv   # its KV was freed
    serial = engine_factory("scheduler=serial")
    assert out["keeper"] == solo(serial, PROMPTS[1], max_tokens=40, logit_bias=EOS_OFF)
    wait_idle(h)


@pytest.mark.parametrize("model", ["tiny", "gemma", "hybrid"])
def test_prompts_arriving_together_prefill_as_one_group(engine_factory, model: str) -> None:
    """Similar-length prompts that arrive together are prefilled in one padded forward
    (left-padded, their caches being empty; the hybrid's recurrent layers take no left
    padding, so it is right-padded and the padding rolled left afterwards) and decode to
    exactly what each produces alone."""
    prompts = [[30 + (7 * i + j) % 200 for j in range(40 + 3 * i)] for i in range(6)]
    serial = engine_factory(f"model={model}", "scheduler=serial")
    expected = [solo(serial, p, max_tokens=12, logit_bias=EOS_OFF) for p in prompts]
    h = engine_factory(f"model={model}", "scheduler=continuous")
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=12, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    assert h.metrics.grouped_prefills._value.get() >= 2
    wait_idle(h)


def test_a_prompt_split_across_steps_does_not_widen_the_batch(engine_factory) -> None:
    """Equal prompts over a token budget that splits one prompt each step: the split row's
    rest does not share a forward with new prompts (that forward would write every chunk after
    its earlier chunk, padding the new rows by it), so the decode batch is as wide as its rows
    plus the steps between their arrivals, and each row decodes what it decodes alone."""
    prompts = [[30 + (7 * i + j) % 200 for j in range(60)] for i in range(8)]
    serial = engine_factory("scheduler=serial")
    expected = [solo(serial, p, max_tokens=10, logit_bias=EOS_OFF) for p in prompts]
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=8",
                       "scheduler.max_num_batched_tokens=142")   # 2 prompts and 24 tokens a step
    forward = h.engine.step.prefill.forward
    widths: list[tuple[int, int]] = []   # (the batch's positions, its longest row's)
    inner = forward.decode

    def decode(rows, kv):
        out = inner(rows, kv)
        c = kv._caches[0] if len(rows) > 1 else None
        if c is not None and c.keys is not None:
            widths.append((c._idx, max(r.start + 1 for r in rows)))
        return out

    forward.decode = decode
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=10, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    assert h.metrics.grouped_prefills._value.get() >= 2   # new prompts still shared forwards
    assert len(widths) > 5
    steps = len(prompts)   # at most one step between two rows' arrivals
    assert all(width <= longest + steps for width, longest in widths), widths
    wait_idle(h)
