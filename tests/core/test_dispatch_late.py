"""scheduler.dispatch_late: a step goes to the device only after the previous step's tokens
are applied and posted. Same tokens as the default order for rows that join, finish at
different steps, sample with seeds and logprobs, follow a grammar (a sync step) and are
cancelled; the engine drains to nothing held."""
from __future__ import annotations

import asyncio

from pipeserve.grammar.constraint import Constraint, GrammarCompiler
from pipeserve.core.stream import RequestStream
from tests.core.test_batching import EOS_OFF, LENGTHS, PROMPTS, wait_idle


def _run(h) -> list[object]:
    tok = h.loaded.tokenizer
    compiler = GrammarCompiler(tok, h.loaded.model.args.vocab_size, tok.eos_token_ids)
    reqs = [h.request(p, max_tokens=n, logit_bias=EOS_OFF) for p, n in zip(PROMPTS, LENGTHS)]
    reqs.append(h.request(PROMPTS[1], max_tokens=24, temperature=0.9, seed=5, logprobs=True,
                          top_logprobs=2))
    constrained = h.request(PROMPTS[2], max_tokens=12)
    constrained.grammar = compiler.matcher(Constraint.choice(["alpha beta", "gamma"],
                                                             "guided_choice"))
    reqs.append(constrained)

    async def go() -> list[object]:
        loop = asyncio.get_running_loop()
        victim = h.request(PROMPTS[3], max_tokens=2000, logit_bias=EOS_OFF)
        vs = RequestStream(loop)
        h.engine.submit(victim, vs)
        got = asyncio.ensure_future(h.generate_many(reqs))
        seen = 0
        while seen < 5:
            seen += len(getattr(await asyncio.wait_for(vs.next(), 30), "token_ids", []))
        h.engine.abort(victim.request_id)
        while not vs.finished:
            await asyncio.wait_for(vs.next(), 30)
        done = await got
        return [g["ids"] for g in done] + [[lp.logprob for lp in done[-2]["logprobs"]]]
    return asyncio.run(go())


def test_late_dispatch_gives_the_default_orders_tokens(engine_factory) -> None:
    expected = _run(engine_factory("scheduler.max_batch=8"))
    late = engine_factory("scheduler.max_batch=8", "scheduler.dispatch_late=true")
    assert late.engine.step.dispatch_late
    got = _run(late)
    assert got[:-1] == expected[:-1]   # every row's tokens
    # logprobs: equal up to the float noise of which rows shared a step (arrival timing)
    assert len(got[-1]) == len(expected[-1]) > 0
    assert all(abs(a - b) < 1e-3 for a, b in zip(got[-1], expected[-1]))
    assert 0 < len(got[-2]) < 12   # the constrained row followed its choice to the end
    wait_idle(late)
