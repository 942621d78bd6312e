"""Speculative decoding through the real server: the OpenAI and Anthropic SDKs see
`usage.speculation`, output equals draft=none, and that holds with the prompt cache hot and
after an SSD restore (target state cached and restored like any other)."""
from __future__ import annotations

from typing import Any

import anthropic

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

COPY = ("Please repeat this passage exactly: the quick brown fox jumps over the lazy dog, "
        "and the lazy dog sleeps in the warm afternoon sun. ") * 6


def chat(base: str, text: str, n: int = 24) -> Any:
    return sdk(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=n,
        temperature=0, logit_bias=NO_EOS)


def test_ngram_usage_speculation_and_equal_output(server_factory, tmp_path) -> None:
    plain = server_factory("cache=off")
    expected = chat(plain.base_url, COPY).choices[0].message.content
    plain.stop()
    s = server_factory("draft=ngram", "cache=ssd", f"cache.ssd.dir={tmp_path}")
    cold = chat(s.base_url, COPY)
    assert cold.choices[0].message.content == expected
    spec = cold.usage.model_extra["speculation"]
    assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    hot = chat(s.base_url, COPY)   # prompt cache hit: same tokens
    assert hot.usage.prompt_tokens_details.cached_tokens > 0
    assert hot.choices[0].message.content == expected
    fams = metric_families(s.base_url)
    assert sample_value(fams, "pipeserve_speculation_proposed_tokens",
                        "pipeserve_speculation_proposed_tokens_total", proposer="ngram") > 0
    msg = anthropic.Anthropic(base_url=s.base_url, api_key="x").messages.create(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": COPY}])
    assert msg.usage.model_extra["speculation"]["proposed"] >= 0
    assert s.stop() == 0
    again = server_factory("draft=ngram", "cache=ssd", f"cache.ssd.dir={tmp_path}")
    restored = chat(again.base_url, COPY)   # restored from disk after the restart
    assert restored.usage.prompt_tokens_details.cached_tokens > 0
    assert restored.choices[0].message.content == expected
