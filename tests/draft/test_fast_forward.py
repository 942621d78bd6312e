"""Fast-forward (draft.fast_forward): where a grammar admits exactly one continuation, a row
appends those tokens in one forward, verified like drafts. On the real tiny model: output
equals sampling them one step at a time (greedy and seeded), batched, with no proposer and
with proposers that keep per-row state (the heads fed the target's hidden states catch up on
the forwarded positions); usage counts the forwarded tokens; the forced stretch costs fewer
steps."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeserve.grammar.constraint import Constraint, GrammarCompiler
from tests.conftest import EngineHarness
from tests.draft.test_speculative import counter, prompts

# a forced tool call: everything but the name's choice and the city is scaffolding
CALL = (r'\{"name": "(get_weather|get_time)", "arguments": \{"city": "[a-z]{1,6}", '
        r'"unit": "celsius"\}\}')


def constrained(h: EngineHarness, n: int = 3, **sampling) -> list[dict]:
    tok = h.loaded.tokenizer
    compiler = GrammarCompiler(tok, h.loaded.model.args.vocab_size, tok.eos_token_ids)
    reqs = []
    for i, p in enumerate(prompts(h, n)):
        extra = {"seed": 5 + i} if sampling.get("temperature") else {}
        req = h.request(p, max_tokens=80, **sampling, **extra)
        req.grammar = compiler.matcher(Constraint.regex(CALL, "guided_regex"))
        reqs.append(req)
    return asyncio.run(h.generate_many(reqs))


def steps(h: EngineHarness) -> float:
    """Engine steps run so far (one batch-size observation each)."""
    return sum(s.value for s in h.metrics.batch_size.collect()[0].samples
               if s.name.endswith("_count"))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 8}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", [["draft=none", "draft.fast_forward=16"], ["draft=ngram"],
                                   ["draft=eagle3"], ["draft=dflash"]],
                         ids=["none", "ngram", "eagle3", "dflash"])
def test_forwarded_output_equals_sampling_each_token(engine_factory, sampling: dict,
                                                     draft: list[str]) -> None:
    plain = engine_factory("model=tiny")
    expected = constrained(plain, **sampling)
    ff = engine_factory("model=tiny", *draft)
    got = constrained(ff, **sampling)
    assert [g["ids"] for g in got] == [g["ids"] for g in expected]
    text = ff.loaded.tokenizer.decode(got[0]["ids"])
    assert text.startswith('{"name": "get_') and text.endswith('"unit": "celsius"}}')
    forwarded = [g["extras"]["speculation"]["forwarded"] for g in got]
    assert all(f > 10 for f in forwarded), forwarded   # the scaffolding, each row
    assert ff.metrics.fast_forward_tokens._value.get() == sum(forwarded)
    assert "speculation" not in expected[0]["extras"]   # plain decoding forwards nothing
    # every output token but the forwarded ones costs a step of its own
    assert steps(ff) < steps(plain) - 10


def test_fast_forward_off_samples_each_token(engine_factory) -> None:
    ff_off = engine_factory("model=tiny", "draft=ngram", "draft.fast_forward=0")
    got = constrained(ff_off, n=1)
    assert got[0]["extras"].get("speculation", {}).get("forwarded", 0) == 0
    assert ff_off.metrics.fast_forward_tokens._value.get() == 0
