"""Every drafter under `n > 1` with logprobs through the real server and the OpenAI SDK: a
request's choices are rows that share the batch (and the first one's prompt-cache entry);
greedy and seeded sampled choices, their logprobs and top alternatives equal the server
without a drafter's, and usage.speculation counts the drafts of all the choices."""
from __future__ import annotations

from typing import Any

import pytest

from tests.draft.test_drafter_rows import DRAFTERS, MODELS, draft_overrides
from tests.serve.test_openai import NO_EOS, sdk

LOGPROB_TOL = 1e-4
QUESTIONS = ["Tell me about trains.", "Count to twenty, please."]


def ask(base: str, **kw: Any) -> list[Any]:
    client = sdk(base)
    name = client.models.list().data[0].id
    return [client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": q}], max_tokens=16,
        logit_bias=NO_EOS, logprobs=True, top_logprobs=2, **kw) for q in QUESTIONS]


def choices(responses: list[Any]) -> list[tuple[str, list[tuple[str, float, list[str]]]]]:
    return [(c.message.content, [(t.token, t.logprob, [a.token for a in t.top_logprobs])
                                 for t in c.logprobs.content])
            for r in responses for c in r.choices]


def assert_same(got: list[Any], want: list[Any]) -> None:
    g, w = choices(got), choices(want)
    assert [c for c, _ in g] == [c for c, _ in w]
    for (_, a), (_, b) in zip(g, w):
        assert [(t, top) for t, _, top in a] == [(t, top) for t, _, top in b]
        assert max(abs(x - y) for (_, x, _), (_, y, _) in zip(a, b)) <= LOGPROB_TOL


REQUESTS = {"greedy": {"n": 2, "temperature": 0},
            "seeded": {"n": 3, "temperature": 0.8, "seed": 11, "extra_body": {"top_k": 8}}}


@pytest.fixture(scope="module")
def plain(server_factory) -> dict[tuple[str, str], list[Any]]:
    """The servers without a drafter: each model's answers to each request."""
    out = {}
    for arch, model in {m[0]: m[1] for m in MODELS.values()}.items():
        s = server_factory(*model, "scheduler=continuous")
        for kind, kw in REQUESTS.items():
            out[arch, kind] = ask(s.base_url, **kw)
        s.stop()
    return out


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_n_choices_with_logprobs_equal_the_plain_server(server_factory, model_cache, plain,
                                                        drafter: str) -> None:
    arch, model = MODELS[drafter]
    s = server_factory(*model, "scheduler=continuous", *draft_overrides(drafter, model_cache))
    for kind, kw in REQUESTS.items():
        got = ask(s.base_url, **kw)
        assert all(len(r.choices) == kw["n"] for r in got)
        assert_same(got, plain[arch, kind])
        if kind == "greedy":
            assert sum(r.usage.model_extra["speculation"]["proposed"] for r in got) > 0
        else:   # each choice draws from its own seed: they differ
            assert all(len({c.message.content for c in r.choices}) > 1 for r in got)
    assert s.stop() == 0
