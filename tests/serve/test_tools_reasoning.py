"""End to end: tool calls and reasoning through every protocol on real `serve.py` processes.
The random tiny model cannot choose to call a tool, so the calls here are real model tokens
steered by real request fields: a named or required tool_choice constrains decoding to the
grammar of a well-formed call, and logit_bias forces markup where a test needs a broken call.
Reasoning uses a chat template that opens <think> in the generation prompt, as thinking models
do."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pipeserve.model.tiny.text import CHAT_TEMPLATE, ensure_model

MODEL = "tiny"
TIMEOUT = 60.0
NO_EOS = {"0": -100, "2": -100}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
CALL_TOKENS = 64   # room for a whole call of get_weather under the grammar
MINIMAL_BUDGET = 3   # thinking tokens reasoning_effort "minimal" gets on the thinking server
CLOSE_TOKENS = 7     # "</think>" is seven tokens of the tiny tokenizer
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
GEN_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_PROMPT = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                   "{%- if enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
                   "{%- endif %}")


@pytest.fixture(scope="module")
def open_call(model_cache: Path) -> dict[str, int]:
    """logit_bias that makes `<tool_call>` every next token: markup that never forms a call."""
    path = ensure_model("qwen3", "tiny", "float32", model_cache) / "tokenizer.json"
    added = json.loads(path.read_text())["added_tokens"]
    return {str(next(t["id"] for t in added if t["content"] == "<tool_call>")): 100}


def args_ok(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) <= {"city"} and isinstance(args.get("city", ""), str) and \
        len(args.get("city", "")) <= 8


@pytest.fixture(scope="module")
def coder(server_factory: Any) -> Any:
    """Tool calls parsed as Qwen3-coder XML (the override of the inferred Hermes format)."""
    return server_factory("model.tool_call_format=qwen3_coder")


@pytest.fixture(scope="module")
def thinker(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A template that opens <think> unless thinking is off; the server default is off."""
    assert GEN_PROMPT in CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    path.write_text(CHAT_TEMPLATE.replace(GEN_PROMPT, THINKING_PROMPT))
    return server_factory(f"model.chat_template={path}", "model.enable_thinking=false",
                          f"model.reasoning_budgets.minimal={MINIMAL_BUDGET}")


def oa(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def an(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=TIMEOUT)


def sse(srv: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
            assert len(out) < 10_000
    return out


# -- tool calls --------------------------------------------------------------------------------
def test_chat_named_tool_choice_yields_a_tool_call(coder: Any) -> None:
    body = {"model": MODEL, "messages": USER, "tools": CHAT_TOOLS, "max_tokens": CALL_TOKENS,
            "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = oa(coder).chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and args_ok(call.function.arguments)

    chunks = sse(coder, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(not d.get("content") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == call.function.arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    stream = oa(coder).chat.completions.create(stream=True, **body)
    typed = [c for c in stream]
    assert typed[-1].choices[0].finish_reason == "tool_calls"
    named = [c.choices[0].delta.tool_calls[0] for c in typed
             if c.choices and c.choices[0].delta.tool_calls]
    assert named[0].function.name == "get_weather"


def test_required_is_enforced_and_broken_markup_stays_text(coder: Any,
                                                           open_call: dict[str, int]) -> None:
    client = oa(coder)
    base = {"model": MODEL, "messages": USER, "temperature": 0}
    # required: decoding is constrained to a call, whatever the model would write
    r = client.chat.completions.create(tools=CHAT_TOOLS, tool_choice="required",
                                       max_tokens=CALL_TOKENS, **base)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and args_ok(call.function.arguments)
    # auto: markup the model opens and max_tokens cuts is dropped and flagged, never leaked
    # as text, nor a 500
    r = client.chat.completions.create(tools=CHAT_TOOLS, max_tokens=3, logit_bias=open_call,
                                       **base)
    assert r.choices[0].message.tool_calls is None
    assert not r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.model_extra["incomplete_tool_call"] is True
    assert "cut by max_tokens, dropped" in coder.log()


def test_tools_render_and_round_trip_and_none(coder: Any) -> None:
    client = oa(coder)

    def prompt_tokens(**kw: Any) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, **kw).usage.prompt_tokens

    plain = prompt_tokens(messages=USER)
    with_tools = prompt_tokens(messages=USER, tools=CHAT_TOOLS)
    assert with_tools > plain
    assert prompt_tokens(messages=USER, tools=CHAT_TOOLS, tool_choice="none") == plain
    trip = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    assert prompt_tokens(messages=trip, tools=CHAT_TOOLS) > with_tools
    # auto with nothing parseable: plain content, no tool_calls
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       max_tokens=16, temperature=0, logit_bias=NO_EOS)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_anthropic_tool_use(coder: Any) -> None:
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    kw = {"model": MODEL, "max_tokens": CALL_TOKENS, "messages": USER, "tools": tools,
          "tool_choice": {"type": "tool", "name": "get_weather"}}
    extra = {"temperature": 0}
    m = an(coder).messages.create(**kw, extra_body=extra)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert args_ok(json.dumps(block.input))
    assert block.id.startswith("toolu_")

    events = sse(coder, "/v1/messages", {**kw, **extra})
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type"))
             for e in events if e["type"] != "ping"]
    assert kinds == [("message_start", None), ("content_block_start", "tool_use"),
                     ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
                     ("message_delta", None), ("message_stop", None)]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    with an(coder).messages.stream(**kw, extra_body=extra) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == block.input


def test_responses_function_call_and_output_round_trip(coder: Any) -> None:
    client = oa(coder)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    kw = {"model": MODEL, "input": "Weather in Paris?", "tools": tools,
          "max_output_tokens": CALL_TOKENS, "temperature": 0, "parallel_tool_calls": False,
          "tool_choice": {"type": "function", "name": "get_weather"}}
    r = client.responses.create(**kw)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert args_ok(call.arguments) and call.call_id.startswith("call_")
    events = list(client.responses.create(**kw, stream=True))
    assert [e.type for e in events[2:]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    nxt = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=tools, max_output_tokens=2,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert nxt.usage.input_tokens > r.usage.input_tokens


# -- reasoning -------------------------------------------------------------------------------
def test_chat_reasoning_content_and_reasoning_effort(thinker: Any) -> None:
    client = oa(thinker)
    kw = {"model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 0,
          "logit_bias": NO_EOS}
    off = client.chat.completions.create(**kw)   # server default: thinking off
    assert off.choices[0].message.content and not off.choices[0].message.model_extra.get(
        "reasoning_content")
    assert client.chat.completions.create(
        **kw, reasoning_effort="none").usage.prompt_tokens == off.usage.prompt_tokens
    on = client.chat.completions.create(**kw, reasoning_effort="high")
    msg = on.choices[0].message
    # the prompt opened <think>: every generated token is reasoning until </think>
    assert msg.model_extra["reasoning_content"] and msg.content == ""
    assert on.usage.completion_tokens_details.reasoning_tokens == 12
    assert on.usage.prompt_tokens < off.usage.prompt_tokens   # open span vs closed span
    same = client.chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert same.choices[0].message.model_extra["reasoning_content"] == msg.model_extra[
        "reasoning_content"]
    chunks = sse(thinker, "/v1/chat/completions", {**kw, "reasoning_effort": "low"})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg.model_extra[
        "reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_anthropic_thinking_blocks(thinker: Any) -> None:
    kw = {"model": MODEL, "max_tokens": 8, "messages": USER,
          "extra_body": {"temperature": 0, "logit_bias": NO_EOS}}
    m = an(thinker).messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    plain = an(thinker).messages.create(**kw)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text
    events = sse(thinker, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": USER,
                                           "temperature": 0, "logit_bias": NO_EOS,
                                           "thinking": {"type": "enabled", "budget_tokens": 1024}})
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta")
    assert thinking == m.content[0].thinking
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking"]


def test_responses_reasoning_items(thinker: Any) -> None:
    client = oa(thinker)
    kw = {"model": MODEL, "input": "Why is the sky blue?", "max_output_tokens": 8,
          "temperature": 0, "extra_body": {"logit_bias": NO_EOS}}
    r = client.responses.create(reasoning={"effort": "medium"}, **kw)
    assert [o.type for o in r.output] == ["reasoning"]   # max_output_tokens hit while reasoning
    assert r.output[0].content[0].text and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    plain = client.responses.create(**kw)
    assert [o.type for o in plain.output] == ["message"] and plain.output_text
    events = list(client.responses.create(reasoning={"effort": "medium"}, stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == r.output[0].content[0].text
    assert [o.type for o in events[-1].response.output] == ["reasoning"]


def test_calls_across_protocols_in_one_batch(coder: Any) -> None:
    """Concurrent requests share engine steps; each keeps its own output parser."""
    from concurrent.futures import ThreadPoolExecutor

    def chat(_: int) -> str:
        r = oa(coder).chat.completions.create(
            model=MODEL, messages=USER, tools=CHAT_TOOLS, max_tokens=CALL_TOKENS, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return r.choices[0].message.tool_calls[0].function.name

    def messages(_: int) -> str:
        m = an(coder).messages.create(
            model=MODEL, max_tokens=CALL_TOKENS, messages=USER,
            tools=[{"name": "get_weather", "input_schema": SCHEMA}],
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
        return m.content[0].name

    def plain(_: int) -> str:
        r = oa(coder).chat.completions.create(model=MODEL, messages=USER, max_tokens=24,
                                              temperature=0, logit_bias=NO_EOS)
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(f, i) for i in range(2) for f in (chat, messages, plain)]
        results = [f.result(timeout=TIMEOUT) for f in futures]
    assert results == ["get_weather", "get_weather", "length"] * 2


# -- thinking budget -------------------------------------------------------------------------
def test_thinking_budget_forces_the_end_marker_and_the_answer_follows(thinker: Any) -> None:
    client = oa(thinker)
    kw = {"model": MODEL, "messages": USER, "max_tokens": 20, "temperature": 0,
          "logit_bias": NO_EOS}
    for budget, extra in ((5, {"reasoning_effort": "high", "extra_body": {"max_reasoning_tokens": 5}}),
                          (MINIMAL_BUDGET, {"reasoning_effort": "minimal"})):
        r = client.chat.completions.create(**kw, **extra)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] and msg.content   # the answer follows
        # the span is the budget's tokens and the forced marker, counted exactly
        assert r.usage.completion_tokens_details.reasoning_tokens == budget + CLOSE_TOKENS
        assert r.usage.completion_tokens == 20
        chunks = sse(thinker, "/v1/chat/completions", {**kw, **extra.get("extra_body", {}),
                                                        **{k: v for k, v in extra.items()
                                                           if k != "extra_body"}})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == \
            msg.model_extra["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg.content
        assert "</think>" not in msg.content
    # a budget the turn cannot reach changes nothing: the whole turn is reasoning
    r = client.chat.completions.create(**kw, reasoning_effort="low",
                                       extra_body={"max_reasoning_tokens": 500})
    assert r.usage.completion_tokens_details.reasoning_tokens == 20 and not r.choices[0].message.content


def test_anthropic_budget_tokens_and_responses_budget(thinker: Any) -> None:
    m = an(thinker).messages.create(
        model=MODEL, max_tokens=16, messages=USER, thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"temperature": 0, "logit_bias": NO_EOS})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[1].text and m.stop_reason == "max_tokens"
    r = oa(thinker).responses.create(model=MODEL, input="Why is the sky blue?", max_output_tokens=16,
                                     temperature=0, reasoning={"effort": "medium"},
                                     extra_body={"logit_bias": NO_EOS, "max_reasoning_tokens": 4})
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens == 4 + CLOSE_TOKENS
    for bad in ({"max_reasoning_tokens": 0}, {"max_reasoning_tokens": "x"}):
        with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
            oa(thinker).chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                                extra_body=bad)
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        an(thinker).messages.create(model=MODEL, max_tokens=4, messages=USER,
                                    thinking={"type": "enabled", "budget_tokens": -1})


# -- assistant prefill -----------------------------------------------------------------------
def test_assistant_prefill_continues_the_turn(coder: Any, thinker: Any) -> None:
    client = oa(coder)
    prefill = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "logit_bias": NO_EOS}
    r = client.chat.completions.create(messages=prefill, **kw,
                                       extra_body={"continue_final_message": True})
    answer = r.choices[0].message.content
    # the same prompt written out as a raw completion continues the same way
    text = ("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
            "The weather in Paris is")
    c = client.completions.create(prompt=text, **kw)
    assert answer == c.choices[0].text and r.usage.prompt_tokens == c.usage.prompt_tokens
    closed = client.chat.completions.create(messages=prefill, **kw)   # a new turn after it
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens
    # Anthropic: a final assistant turn is a prefill; only the continuation comes back
    m = an(coder).messages.create(model=MODEL, max_tokens=6, messages=prefill,
                                  extra_body={"temperature": 0, "logit_bias": NO_EOS})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == answer
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == r.usage.prompt_tokens
    # the output parsers start where the prefill left them: an open <think> goes on as reasoning
    t = oa(thinker).chat.completions.create(
        messages=[*USER, {"role": "assistant", "content": "<think>\nLet me see"}], **kw,
        extra_body={"continue_final_message": True})
    assert t.choices[0].message.model_extra["reasoning_content"]
    assert not t.choices[0].message.content
    assert t.usage.completion_tokens_details.reasoning_tokens == 6
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(messages=USER, **kw,
                                       extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="prefills"):
        client.chat.completions.create(messages=prefill, tools=CHAT_TOOLS, tool_choice="required",
                                       **kw, extra_body={"continue_final_message": True})


def test_strict_tools_in_auto_mode_finish_the_call_the_model_opens(
        coder: Any, open_call: dict[str, int]) -> None:
    """logit_bias makes the model open a call at every step. Without strict the markup is
    garbage cut by max_tokens: dropped and flagged, never text; with a strict tool the grammar
    finishes the opened call schema-valid, and with parallel calls off no second call opens."""
    client = oa(coder)
    kw = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 48,
          "logit_bias": open_call, "parallel_tool_calls": False}
    loose = client.chat.completions.create(tools=CHAT_TOOLS, **kw)
    assert loose.choices[0].message.tool_calls is None
    assert not loose.choices[0].message.content
    assert loose.usage.model_extra["incomplete_tool_call"] is True
    strict = [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}]
    r = client.chat.completions.create(tools=strict, **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and args_ok(call.function.arguments)
    assert "<tool_call>" not in (r.choices[0].message.content or "")
