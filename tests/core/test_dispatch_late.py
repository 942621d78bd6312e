"""scheduler.dispatch_late: a step goes to the device only after the previous step's tokens
are applied and posted (a GPU's default). Same tokens as the early order (a CPU's) for rows
that join, finish at different steps, sample with seeds and logprobs, follow a grammar (a sync
step) and are cancelled; the engine drains to nothing held."""
from __future__ import annotations

import asyncio

import mlx.core as mx

from pipeserve.core.config import SchedulerConfig
from pipeserve.core.stream import RequestStream
from pipeserve.grammar.constraint import Constraint, GrammarCompiler
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


def test_late_dispatch_gives_the_early_orders_tokens(engine_factory) -> None:
    early = engine_factory("scheduler.max_batch=8", "scheduler.dispatch_late=false")
    assert not early.engine.step.dispatch_late
    expected = _run(early)
    late = engine_factory("scheduler.max_batch=8", "scheduler.dispatch_late=true")
    assert late.engine.step.dispatch_late
    got = _run(late)
    assert got[:-1] == expected[:-1]   # every row's tokens
    # logprobs: equal up to the float noise of which rows shared a step (arrival timing)
    assert len(got[-1]) == len(expected[-1]) > 0
    assert all(abs(a - b) < 1e-3 for a, b in zip(got[-1], expected[-1]))
    assert 0 < len(got[-2]) < 12   # the constrained row followed its choice to the end
    wait_idle(late)


def test_unset_it_is_on_for_a_gpu_and_off_for_a_cpu(engine_factory) -> None:
    """The default follows the device: on MLX's CUDA backend the event loop's writes then run
    inside async_eval; a CPU's device would idle while it waits."""
    unset = SchedulerConfig()
    assert unset.dispatch_late is None
    assert unset.late_dispatch(on_gpu=True) and not unset.late_dispatch(on_gpu=False)
    assert not SchedulerConfig(dispatch_late=False).late_dispatch(on_gpu=True)
    assert SchedulerConfig(dispatch_late=True).late_dispatch(on_gpu=False)
    h = engine_factory("scheduler.max_batch=8")   # this suite's MLX runs on the CPU
    assert h.engine.step.dispatch_late is (mx.default_device().type == mx.DeviceType.gpu)
