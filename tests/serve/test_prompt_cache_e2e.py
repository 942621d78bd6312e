"""The prompt cache as clients see it: OpenAI `cached_tokens`, Anthropic
`cache_read_input_tokens`, identical greedy text, and the cache metrics."""
from __future__ import annotations

from typing import Any

import anthropic

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

SYSTEM = "You are a careful assistant. " * 20


def test_openai_reports_cached_tokens_and_text_is_identical(server: Any) -> None:
    client = sdk(server.base_url)
    body = dict(model="tiny", temperature=0, max_tokens=12, logit_bias=NO_EOS,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "Tell me about caching."}])
    first = client.chat.completions.create(**body)
    second = client.chat.completions.create(**body)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    other = client.chat.completions.create(**{**body, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Another turn."}]})
    assert 100 < other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens
    fams = metric_families(server.base_url)
    assert sample_value(fams, "pipeserve_prompt_cache_hits", "pipeserve_prompt_cache_hits_total",
                        cache_tier="ram") >= 2
    assert sample_value(fams, "pipeserve_prompt_cache_entries", "pipeserve_prompt_cache_entries",
                        cache_tier="ram") >= 1


def test_anthropic_reports_cache_read_input_tokens(server: Any) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                                 timeout=60)
    body = dict(model="tiny", max_tokens=8, system="(anthropic) " + SYSTEM,
                messages=[{"role": "user", "content": "Hello there"}])
    first = client.messages.create(**body)
    second = client.messages.create(**body)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_read_input_tokens < 10   # only the template's opening is shared
    assert second.usage.cache_read_input_tokens == total - 1   # all but the last token
    assert second.usage.input_tokens == 1                      # Anthropic: uncached input only
