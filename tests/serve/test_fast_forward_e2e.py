"""Fast-forward through the real server: a named tool_choice constrains decoding to a call of
that tool, whose scaffolding the grammar forces; with draft.fast_forward the OpenAI and
Anthropic SDKs get the same call as without it, and usage.speculation.forwarded counts the
tokens appended without a step each."""
from __future__ import annotations

from typing import Any

import anthropic

from tests.serve.test_openai import metric_families, sample_value, sdk

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["celsius"]}},
          "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(base: str) -> Any:
    return sdk(base).chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})


def anthropic_call(base: str) -> Any:
    return anthropic.Anthropic(base_url=base, api_key="x").messages.create(
        model="tiny", max_tokens=64, messages=USER, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"})


def test_forced_tool_call_is_forwarded_and_unchanged(server_factory) -> None:
    plain = server_factory("cache=off")
    expected = call(plain.base_url)
    expected_msg = anthropic_call(plain.base_url)
    assert "speculation" not in (expected.usage.model_extra or {})
    plain.stop()
    ff = server_factory("cache=off", "draft=none", "draft.fast_forward=16",
                        "scheduler=continuous")
    got = call(ff.base_url)
    [want], [have] = expected.choices[0].message.tool_calls, got.choices[0].message.tool_calls
    assert have.function.name == want.function.name == "get_weather"
    assert have.function.arguments == want.function.arguments
    assert got.usage.completion_tokens == expected.usage.completion_tokens
    forwarded = got.usage.model_extra["speculation"]["forwarded"]
    assert forwarded > 5   # '"unit": "celsius"' and the call's markup, at least
    msg = anthropic_call(ff.base_url)
    assert [b.model_dump() for b in msg.content if b.type == "tool_use"][0]["input"] == \
        [b.model_dump() for b in expected_msg.content if b.type == "tool_use"][0]["input"]
    msg_forwarded = msg.usage.model_extra["speculation"]["forwarded"]
    assert msg_forwarded > 5
    fams = metric_families(ff.base_url)
    assert sample_value(fams, "pipeserve_fast_forward_tokens",
                        "pipeserve_fast_forward_tokens_total") == forwarded + msg_forwarded
