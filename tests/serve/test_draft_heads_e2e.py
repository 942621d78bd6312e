"""Drafters fed the target's hidden states through the real server (`python serve.py
model=tiny draft=eagle3`, `... draft=dflash`, `python serve.py model=tiny model.arch=gemma4
draft=assistant`): the generated head drafts, the OpenAI and Anthropic SDKs get draft=none's
text, batched, with usage.speculation and the proposer's metrics."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

PROMPTS = ["Tell me about trains.", "Count to twenty, please.", "Write a short poem."]


def chat(base: str, text: str) -> object:
    return sdk(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=32,
        temperature=0, logit_bias=NO_EOS)


def all_chats(base: str) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:   # concurrent: the rows share a batch
        return list(pool.map(lambda t: chat(base, t), PROMPTS))


@pytest.fixture(scope="module")
def expected(server_factory) -> list[str]:
    plain = server_factory("model=tiny", "scheduler=continuous")
    texts = [r.choices[0].message.content for r in all_chats(plain.base_url)]
    plain.stop()
    return texts


@pytest.mark.parametrize("proposer", ["eagle3", "dflash"])
def test_head_serves_draft_none_output(server_factory, expected: list[str],
                                       proposer: str) -> None:
    s = server_factory("model=tiny", f"draft={proposer}", "scheduler=continuous")
    got = all_chats(s.base_url)
    assert [r.choices[0].message.content for r in got] == expected
    spec = [r.usage.model_extra["speculation"] for r in got]
    assert all(x["proposed"] > 0 and 0 <= x["accepted"] <= x["proposed"] for x in spec)
    fams = metric_families(s.base_url)
    assert sample_value(fams, "pipeserve_speculation_proposed_tokens",
                        "pipeserve_speculation_proposed_tokens_total",
                        proposer=proposer) == sum(x["proposed"] for x in spec)
    msg = anthropic.Anthropic(base_url=s.base_url, api_key="x").messages.create(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": PROMPTS[0]}],
        extra_body={"temperature": 0, "logit_bias": NO_EOS})
    assert msg.usage.model_extra["speculation"]["proposed"] > 0
    assert msg.content[0].text == expected[0][:len(msg.content[0].text)]


def test_gemma_assistant_serves_draft_none_output(server_factory) -> None:
    """The Gemma 4 assistant reads the target's KV of the shared batch: concurrent rows get
    the plain server's text, and its drafts are kept some of the time."""
    gemma = ("model=tiny", "model.arch=gemma4", "scheduler=continuous")
    plain = server_factory(*gemma)
    want = [r.choices[0].message.content for r in all_chats(plain.base_url)]
    plain.stop()
    s = server_factory(*gemma, "draft=assistant")
    got = all_chats(s.base_url)
    assert [r.choices[0].message.content for r in got] == want
    spec = [r.usage.model_extra["speculation"] for r in got]
    assert all(x["proposed"] > 0 for x in spec)
    assert 0 < sum(x["accepted"] for x in spec) < sum(x["proposed"] for x in spec)
    fams = metric_families(s.base_url)
    assert sample_value(fams, "pipeserve_speculation_accepted_tokens",
                        "pipeserve_speculation_accepted_tokens_total",
                        proposer="assistant") == sum(x["accepted"] for x in spec)
    assert s.stop() == 0
