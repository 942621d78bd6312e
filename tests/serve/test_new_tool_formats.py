"""End to end: the MiniCPM5, Kimi-K3, LongCat, Muse Spark, MiniMax-M3 and Step-3 tool formats on
real `serve.py` processes through the real `openai` and `anthropic` SDKs. The tiny model cannot
choose to call a tool, so a named tool_choice constrains decoding to the grammar of a well-formed
call in the format's own markup; the server parses that markup back into the protocol's call
objects, and the call and its result go back into the next turn."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

MODEL = "tiny"
TIMEOUT = 60.0
SCHEMA = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                         "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TOKENS = 256   # room for a whole call under the grammar (XTML markers are many tiny-model tokens)
MARKUP = ("<function", "<|open|>", "<longcat", "<atem:", "<param", "argument", "]<]minimax",
          "steptml", "tool_call")


@pytest.fixture(scope="module", params=["minicpm5", "kimi_k3", "longcat", "muse_spark",
                                                "minimax_m3", "step3"])
def srv(request: pytest.FixtureRequest, server_factory: Any) -> Any:
    return server_factory(f"model.tool_call_format={request.param}")


def valid(args: dict[str, Any]) -> bool:
    return (set(args) <= {"city", "days"} and isinstance(args.get("city"), str)
            and len(args["city"]) <= 8
            and ("days" not in args or (type(args["days"]) is int and 1 <= args["days"] <= 7)))


def test_openai_named_call_streams_and_round_trips(srv: Any) -> None:
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=TIMEOUT)
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": CALL_TOKENS,
            "temperature": 0, "parallel_tool_calls": False,   # one call: the random model
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # may not stop
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and valid(json.loads(call.function.arguments))

    chunks = list(client.chat.completions.create(stream=True, **body))
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(m in (d.content or "") for d in streamed for m in MARKUP)
    pieces = [d.tool_calls[0] for d in streamed if d.tool_calls]
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    nxt = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         max_tokens=4, temperature=0)
    assert nxt.usage.prompt_tokens > r.usage.prompt_tokens


def test_anthropic_named_tool_use(srv: Any) -> None:
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    m = client.messages.create(
        model=MODEL, max_tokens=CALL_TOKENS, messages=USER,
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and valid(block.input)
