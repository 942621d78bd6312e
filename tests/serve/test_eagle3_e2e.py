"""draft=eagle3 through the real server (`python serve.py model=tiny draft=eagle3`): the
generated EAGLE-3 head drafts, OpenAI and Anthropic SDKs get draft=none's text, batched, with
usage.speculation and the proposer's metrics."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

PROMPTS = ["Tell me about trains.", "Count to twenty, please.", "Write a short poem."]


def chat(base: str, text: str) -> object:
    return sdk(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=32,
        temperature=0, logit_bias=NO_EOS)


def all_chats(base: str) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:   # concurrent: the rows share a batch
        return list(pool.map(lambda t: chat(base, t), PROMPTS))


def test_eagle3_serves_draft_none_output(server_factory) -> None:
    plain = server_factory("model=tiny", "scheduler=continuous")
    expected = [r.choices[0].message.content for r in all_chats(plain.base_url)]
    plain.stop()
    s = server_factory("model=tiny", "draft=eagle3", "scheduler=continuous")
    got = all_chats(s.base_url)
    assert [r.choices[0].message.content for r in got] == expected
    spec = [r.usage.model_extra["speculation"] for r in got]
    assert all(x["proposed"] > 0 and 0 <= x["accepted"] <= x["proposed"] for x in spec)
    fams = metric_families(s.base_url)
    assert sample_value(fams, "pipeserve_speculation_proposed_tokens",
                        "pipeserve_speculation_proposed_tokens_total",
                        proposer="eagle3") == sum(x["proposed"] for x in spec)
    msg = anthropic.Anthropic(base_url=s.base_url, api_key="x").messages.create(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": PROMPTS[0]}],
        extra_body={"temperature": 0, "logit_bias": NO_EOS})
    assert msg.usage.model_extra["speculation"]["proposed"] > 0
    assert msg.content[0].text == expected[0][:len(msg.content[0].text)]
