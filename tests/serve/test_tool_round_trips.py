"""Agent-style tool round trips through the real `openai` and `anthropic` SDKs on real
`serve.py` processes serving two families' real chat templates: gpt-oss (harmony channels) and
GLM-4.6. Each loop streams a call the grammar enforces, sends the tool's result back
(`role: tool` / `tool_result`), and gets the final answer as content. The transcript is printed
(pytest -s shows it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from pipeserve.model.tiny.text import ensure_model

MODEL = "tiny"
TIMEOUT = 60.0
TEMPLATES = Path(__file__).resolve().parent.parent / "markup" / "templates"
WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 8, "description": "City name"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}}]
USER = {"role": "user", "content": "What is the weather in Paris?"}
NO_EOS = {"0": -100, "2": -100}


@pytest.fixture(scope="module")
def servers(server_factory: Any) -> dict[str, Any]:
    """Both started at once (their loads overlap), then awaited."""
    started = {name: server_factory(f"model.chat_template={TEMPLATES / f'{name}.jinja'}",
                                    wait=False) for name in ("gpt-oss", "glm-4.6")}
    for s in started.values():
        s.wait_ready()
    return started


def oa(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def streamed_call(client: openai.OpenAI, **kw: Any) -> tuple[str, str, str, list[str]]:
    """One streamed turn: (call id, name, arguments, the chunk kinds seen)."""
    call_id = name = ""
    args, kinds = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            kinds.append("content")
        if (delta.model_extra or {}).get("reasoning_content"):
            kinds.append("reasoning")
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            kinds.append("tool_call")
            call_id = tc.id or call_id
            name = (tc.function.name if tc.function and tc.function.name else name)
            args.append(tc.function.arguments or "")
        if choice.finish_reason:
            kinds.append(f"finish:{choice.finish_reason}")
    return call_id, name, "".join(args), kinds


@pytest.mark.parametrize("family", ["gpt-oss", "glm-4.6"])
def test_openai_agent_loop_streams_a_call_then_answers(servers: dict[str, Any], family: str) -> None:
    srv = servers[family]
    client = oa(srv)
    # the model may reason first (harmony's analysis channel, GLM's <think>): at most 4 tokens
    kw = {"model": MODEL, "tools": TOOLS, "temperature": 0, "max_tokens": 128,
          "parallel_tool_calls": False, "extra_body": {"max_reasoning_tokens": 4}}
    call_id, name, arguments, kinds = streamed_call(
        client, messages=[USER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **kw)
    args = json.loads(arguments)
    assert name == "get_weather" and call_id.startswith("call_")
    assert set(args) == {"city"} and len(args["city"]) <= 8
    assert kinds[-1] == "finish:tool_calls" and "content" not in kinds
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(messages=history, logit_bias=NO_EOS, **{
        **kw, "max_tokens": 12, "extra_body": {}})
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason == "length"
    first = client.chat.completions.create(messages=[USER], **{**kw, "max_tokens": 1,
                                                                "extra_body": {}})
    assert final.usage.prompt_tokens > first.usage.prompt_tokens   # the call and result went in
    markup = next(ln for ln in srv.log().splitlines() if "output markup: " in ln)
    print(f"\n[{family}] server: {markup.split('output markup: ')[1]}")
    print(f"[{family}] streamed chunks: {kinds}; tool_calls[0] = {name}({arguments}) id={call_id}")
    print(f"[{family}] role=tool 'Sunny, 21 C' -> answer ({answer.finish_reason}): "
          f"{answer.message.content!r}")


def test_anthropic_agent_loop_on_glm(servers: dict[str, Any]) -> None:
    srv = servers["glm-4.6"]
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    tools = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]
    user = {"role": "user", "content": "What is the weather in Paris?"}
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[user], tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    reply = client.messages.create(
        model=MODEL, max_tokens=12, tools=tools, extra_body={"temperature": 0, "logit_bias": NO_EOS},
        messages=[user, {"role": "assistant", "content": [use.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 21 C"}]}])
    assert reply.stop_reason == "max_tokens"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    print(f"\n[glm-4.6 anthropic] tool_use {use.name}({json.dumps(use.input)}) id={use.id} -> "
          f"tool_result 'Sunny, 21 C' -> text {reply.content[0].text!r}")


def test_gpt_oss_responses_items_and_structured_answer(servers: dict[str, Any],
                                                       model_cache: Path) -> None:
    """Harmony through Responses: the analysis channel is a reasoning item, the call a
    function_call item; structured output is the final channel's message, after the analysis."""
    client = oa(servers["gpt-oss"])
    r = client.responses.create(
        model=MODEL, input=[USER], max_output_tokens=128, temperature=0,
        tools=[{"type": "function", **TOOLS[0]["function"]}], parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "get_weather"},
        extra_body={"max_reasoning_tokens": 4})
    kinds = [o.type for o in r.output]
    assert kinds[-1] == "function_call" and set(kinds) <= {"reasoning", "function_call"}
    assert r.output[-1].name == "get_weather" and set(json.loads(r.output[-1].arguments)) == {"city"}
    # the analysis span: its 4 budgeted tokens and <|end|>'s, forced at the budget
    end = len(Tokenizer.from_file(str(ensure_model("qwen3", "tiny", "float32", model_cache)
                                      / "tokenizer.json")).encode("<|end|>").ids)
    assert r.usage.output_tokens_details.reasoning_tokens == (4 + end if "reasoning" in kinds
                                                              else 0)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
              "additionalProperties": False}
    c = client.chat.completions.create(
        model=MODEL, messages=[USER], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        extra_body={"max_reasoning_tokens": 4})
    assert set(json.loads(c.choices[0].message.content)) == {"ok"}
    print(f"\n[gpt-oss responses] output items {kinds}; structured answer "
          f"{c.choices[0].message.content!r} after reasoning "
          f"{(c.choices[0].message.model_extra or {}).get('reasoning_content')!r}")
