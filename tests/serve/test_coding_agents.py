"""Coding agents' request shapes through a real server and the real SDKs. Claude Code's
attribution line (`x-anthropic-billing-header: ...; cch=<random>;`, its first system block,
new on every request) is a volatile span: removed before tokenize, so turns 2 and 3 of a
session reuse the whole prefix they share with the turn before; with server.volatile_spans=null
the cache stops at the line."""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serve.test_anthropic import NO_EOS
from tests.serve.test_openai import TIMEOUT

SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude. You are an interactive "
          "agent that helps users with software engineering tasks. Use the tools available to "
          "you to read files, run commands and edit code. ") * 4
TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}},
         {"name": "Read", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]},
          "cache_control": {"type": "ephemeral"}}]
PROMPTS = ["List the files in this repository.", "Now read the README.",
           "Summarise what the project does."]


def billing() -> str:
    """Claude Code's attribution line: a fresh random `cch` on every request."""
    return (f"x-anthropic-billing-header: cc_version=2.1.37.{secrets.token_hex(2)}; "
            f"cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};")


def turn_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One request as Claude Code shapes it: the billing block, the system prompt marked
    for caching, tools, metadata, the last user block marked too."""
    return {"model": "tiny", "system": [
        {"type": "text", "text": billing()},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS, "messages": messages,
        "metadata": {"user_id": "user_abc_account__session_1234"}}


def session(client: anthropic.Anthropic) -> list[tuple[int, int, Any]]:
    """Three turns; per turn (prompt tokens of the turn before, cached tokens, raw response)."""
    messages: list[dict[str, Any]] = []
    out: list[tuple[int, int, Any]] = []
    previous = 0
    for prompt in PROMPTS:
        messages.append({"role": "user", "content": [
            {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]})
        body = turn_body(messages)
        raw = client.messages.with_raw_response.create(
            max_tokens=8, extra_body={"temperature": 0, "logit_bias": NO_EOS},
            extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
            **body)
        m = raw.parse()
        usage = m.usage
        total = (usage.input_tokens + usage.cache_creation_input_tokens
                 + usage.cache_read_input_tokens)
        out.append((previous, usage.cache_read_input_tokens, raw))
        previous = total
        messages[-1]["content"][0].pop("cache_control")
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": m.content[0].text}]})
    return out


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory()


def client_of(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                               timeout=TIMEOUT)


def test_billing_line_does_not_defeat_the_prefix_cache(srv: Any) -> None:
    turns = session(client_of(srv))
    for previous, cached, raw in turns[1:]:
        # the whole previous prompt is reused but its generation prompt (a few tokens),
        # which the next turn renders as the assistant's reply instead
        assert cached >= previous - 4, [(p, c) for p, c, _ in turns]
        assert raw.headers["x-pipeserve-volatile"] == "claude_code_billing"
    metrics = srv_metrics(srv)
    assert 'pipeserve_volatile_spans_total{span="claude_code_billing"} 3.0' in metrics


def test_count_tokens_ignores_the_billing_line(srv: Any) -> None:
    client = client_of(srv)
    body = turn_body([{"role": "user", "content": "hi"}])
    body.pop("metadata")   # not a count_tokens parameter
    with_line = client.messages.count_tokens(**body).input_tokens
    body["system"] = body["system"][1:]
    assert client.messages.count_tokens(**body).input_tokens == with_line


def test_off_with_one_key_the_line_breaks_the_prefix(server_factory: Any) -> None:
    off = server_factory("server.volatile_spans=null")
    turns = session(client_of(off))
    for previous, cached, raw in turns[1:]:
        assert cached < 40 < previous, [(p, c) for p, c, _ in turns]   # stops at the cch
        assert "x-pipeserve-volatile" not in raw.headers
        miss = raw.parse().usage.model_extra["cache_miss"]
        assert miss["reason"] == "diverged_at" and miss["index"] == cached


def srv_metrics(srv: Any) -> str:
    return httpx.get(srv.base_url + "/metrics", timeout=TIMEOUT).text


# -- Codex: Responses tools beside functions ---------------------------------------------------
LARK = 'start: "*** Begin Patch\\n" hunk+ "*** End Patch"\nhunk: /[^\\n]*\\n/'
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                 "items": {"type": "string"}}},
                    "required": ["command"]}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": LARK}},
    {"type": "custom", "name": "ticket", "description": "File a ticket by its id",
     "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{2}"}},
    {"type": "web_search"},
    {"type": "local_shell"},
    {"type": "image_generation", "output_format": "png"},
    {"type": "namespace", "name": "mcp__docs", "tools": []},
]
DROPPED = ("tools[3] (web_search), tools[4] (local_shell), tools[5] (image_generation), "
           "tools[6] (namespace)")


def oa(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def codex(srv: Any, **kw: Any) -> Any:
    body = {"model": "tiny", "instructions": "You are Codex.", "input": "Fix the bug.",
            "tools": CODEX_TOOLS, "max_output_tokens": 48, "temperature": 0, **kw}
    return oa(srv).responses.with_raw_response.create(**body)


def test_codex_tools_hosted_ones_dropped_and_named(srv: Any) -> None:
    raw = codex(srv, max_output_tokens=4)
    r = raw.parse()
    assert raw.status_code == 200 and r.status in ("completed", "incomplete")
    assert DROPPED in raw.headers["x-pipeserve-warning"]
    assert [(t.type, t.name) for t in r.tools] == [
        ("function", "shell"), ("custom", "apply_patch"), ("custom", "ticket")]
    assert r.tools[1].format.definition == LARK


def test_a_custom_tools_extra_fields_are_not_echoed_nor_stored(srv: Any) -> None:
    """A custom tool is echoed with the fields a custom tool has: an unknown field nested past
    orjson's 254 levels used to reach the response store and end the request in a 500 after
    its tokens were generated (the fuzz campaign's find)."""
    deep = '{"a": ' * 300 + "0" + "}" * 300
    body = ('{"model": "tiny", "input": "Fix the bug.", "max_output_tokens": 2, "tools": '
            '[{"type": "custom", "name": "ticket", "description": "File a ticket", '
            '"parameters": %s}]}' % deep)
    r = httpx.post(f"{srv.base_url}/v1/responses", content=body, timeout=TIMEOUT,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["tools"] == [{"type": "custom", "name": "ticket",
                                  "description": "File a ticket"}]
    again = httpx.get(f"{srv.base_url}/v1/responses/{r.json()['id']}", timeout=TIMEOUT)
    assert again.status_code == 200 and again.json()["tools"] == r.json()["tools"]


DEEP = '{"a": ' * 300 + "0" + "}" * 300   # past orjson's 254-level writer
# (the fields sent, one unknown field nested 300 deep; the field as the response repeats it)
ECHOED = {
    "text.format": ('"text": {"format": {"type": "text", "schema": %s}}' % DEEP,
                    lambda r: r["text"]["format"], {"type": "text"}),
    "tool_choice": ('"tools": [{"type": "function", "name": "f"}], '
                    '"tool_choice": {"type": "function", "name": "f", "x": %s}' % DEEP,
                    lambda r: r["tool_choice"], {"type": "function", "name": "f"}),
    "custom format": ('"tools": [{"type": "custom", "name": "t", "format": {"type": "grammar", '
                      '"syntax": "regex", "definition": "a+", "x": %s}}]' % DEEP,
                      lambda r: r["tools"][0]["format"],
                      {"type": "grammar", "syntax": "regex", "definition": "a+"}),
}


@pytest.fixture(scope="module")
def echo_srv(server_factory: Any) -> Any:
    """A server of its own: the forced tool_choice call is cut short, which counts in the
    incomplete-tool-calls total another test reads from `srv`."""
    return server_factory()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(ECHOED))
def test_fields_the_response_repeats_are_repeated_without_unknown_fields(
        echo_srv: Any, name: str, stream: bool) -> None:
    """text.format, a named tool_choice and a custom tool's format are repeated in the
    response with the fields they have: each used to be repeated as sent, so an unknown field
    nested 300 deep ended the request in a 500 after its tokens were generated, streamed or
    not (the fuzz campaign's find: text.format {"type": "text", "schema": <deep>})."""
    sent, repeated, want = ECHOED[name]
    body = ('{"model": "tiny", "input": "Fix the bug.", "max_output_tokens": 2, '
            '"stream": %s, %s}' % (json.dumps(stream), sent))
    r = httpx.post(f"{echo_srv.base_url}/v1/responses", content=body, timeout=TIMEOUT,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        got = events[-1]["response"]
    else:
        got = r.json()
    assert repeated(got) == want
    again = httpx.get(f"{echo_srv.base_url}/v1/responses/{got['id']}", timeout=TIMEOUT)
    assert again.status_code == 200 and repeated(again.json()) == want


def test_custom_tool_call_under_its_regex(srv: Any) -> None:
    choice = {"type": "custom", "name": "ticket"}
    r = codex(srv, tool_choice=choice, parallel_tool_calls=False).parse()
    [call] = r.output
    assert call.type == "custom_tool_call" and call.name == "ticket"
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", call.input), call.input
    events = list(oa(srv).responses.create(
        model="tiny", input="Fix the bug.", tools=CODEX_TOOLS, max_output_tokens=48,
        temperature=0, tool_choice=choice, parallel_tool_calls=False, stream=True))
    assert [e.type for e in events[2:]] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.completed"]
    assert events[-1].response.output[0].input == events[-2].item.input
    # the call and its output go back as items, as Codex sends the next turn
    nxt = codex(srv, max_output_tokens=2, input=[
        {"role": "user", "content": "Fix the bug."},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "ticket",
         "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "filed"}]).parse()
    assert nxt.usage.input_tokens > r.usage.input_tokens


@pytest.fixture(scope="module")
def strict(server_factory: Any) -> Any:
    return server_factory("server.strict_fields=true")


def test_strict_fields_refuses_hosted_tools_by_name(strict: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        codex(strict)
    err = info.value.response.json()["error"]
    assert err["param"] == "tools[3]" and "'web_search'" in err["message"]


# -- no tool call lost, no markup leaked -----------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
CUT = 60   # tokens: one whole call of get_weather under the grammar, the second cut short
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def no_markup(text: str | None) -> bool:
    return not text or ("<tool_call>" not in text and '"name"' not in text)


def incomplete_calls(srv: Any) -> float:
    for line in srv_metrics(srv).splitlines():
        if line.startswith("pipeserve_incomplete_tool_calls_total "):
            return float(line.split()[1])
    raise AssertionError("pipeserve_incomplete_tool_calls_total is not on /metrics")


def test_a_forced_call_cut_by_max_tokens_never_leaks_markup(srv: Any) -> None:
    before = incomplete_calls(srv)   # a shared server: other tests may cut calls too
    # Anthropic, tool_choice any: the whole call, then one cut short and dropped
    m = client_of(srv).messages.create(
        model="tiny", max_tokens=CUT, messages=ASK, tool_choice={"type": "any"},
        tools=[{"name": "get_weather", "input_schema": CITY}], extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].input == {"city": "Paris"}
    assert m.usage.model_extra["incomplete_tool_call"] is True
    with client_of(srv).messages.stream(
            model="tiny", max_tokens=CUT, messages=ASK, tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": CITY}],
            extra_body={"temperature": 0}) as stream:
        texts = [e.delta.text for e in stream if e.type == "content_block_delta"
                 and e.delta.type == "text_delta"]
        final = stream.get_final_message()
    assert all(no_markup(t) for t in texts) and [b.type for b in final.content] == ["tool_use"]
    # Responses, tool_choice required
    rtools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    r = oa(srv).responses.create(model="tiny", input="Weather in Paris?", tools=rtools,
                                 tool_choice="required", max_output_tokens=CUT, temperature=0)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["function_call"]
    assert r.usage.model_extra["incomplete_tool_call"] is True
    events = list(oa(srv).responses.create(
        model="tiny", input="Weather in Paris?", tools=rtools, tool_choice="required",
        max_output_tokens=CUT, temperature=0, stream=True))
    assert not [e for e in events if e.type == "response.output_text.delta"]
    # streaming chat, tool_choice required
    chunks = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": "tiny", "messages": ASK, "max_tokens": CUT, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather",
                                                        "parameters": CITY}}]}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            assert len(chunks) < 10_000
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(no_markup(d.get("content")) for d in deltas)
    assert len([d for d in deltas if d.get("tool_calls") and d["tool_calls"][0].get("id")]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["incomplete_tool_call"] is True
    assert incomplete_calls(srv) - before == 5   # each of the five cut calls counted once


def test_system_entries_inside_messages_join_the_system_prompt(srv: Any) -> None:
    """Claude Code sends `role: system` inside `messages` for a model it does not know."""
    client = client_of(srv)
    inline = [{"role": "user", "content": "hi"},
              {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]
    folded = [m for m in inline if m["role"] != "system"]
    sent = client.messages.count_tokens(model="tiny", system="You are Claude Code.",
                                        messages=inline).input_tokens
    same = client.messages.count_tokens(model="tiny", system="You are Claude Code.\n\nBe brief.",
                                        messages=folded).input_tokens
    assert sent == same
    m = client.messages.create(model="tiny", max_tokens=2, messages=inline)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_max_tokens_past_the_context_is_clamped_and_said(srv: Any, strict: Any) -> None:
    """Claude Code and opencode ask max_tokens 32000 of any model; tiny's context is 4096."""
    raw = client_of(srv).messages.with_raw_response.create(
        model="tiny", max_tokens=32000, messages=ASK,
        extra_body={"temperature": 0, "logit_bias": {"2": 100}})
    m = raw.parse()
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    room = 4096 - prompt
    assert m.usage.model_extra["max_tokens_clamped"] == room
    assert f"max_tokens is 32000 but the prompt ({prompt} tokens) leaves {room} of the " \
           f"4096-token context: clamped to {room}" in raw.headers["x-pipeserve-warning"]
    chat = oa(srv).chat.completions.create(model="tiny", messages=ASK, max_tokens=9000,
                                           logit_bias={"2": 100})
    assert chat.usage.model_extra["max_tokens_clamped"] == 4096 - chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client_of(strict).messages.create(model="tiny", max_tokens=32000, messages=ASK)
    message = info.value.body["error"]["message"]
    # Anthropic's wording, which Claude Code parses to retry with a smaller max_tokens
    assert message.startswith(f"input length and `max_tokens` exceed context limit: {prompt} + "
                              "32000 > 4096, decrease input length or `max_tokens` and try again")
    assert "lower max_tokens" in message


def test_anthropic_errors_are_worded_and_typed_as_anthropic_words_them(srv: Any) -> None:
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client_of(srv).messages.create(model="tiny", max_tokens=8, messages=long)
    err = info.value.body["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("prompt is too long: ") and "> 4096 maximum" in err["message"]
    r = httpx.post(srv.base_url + "/v1/messages/nope", json={}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_head_on_the_root_and_the_api_root(srv: Any) -> None:
    for path in ("/", "/v1", "/v1/"):
        r = httpx.head(srv.base_url + path, timeout=TIMEOUT)
        assert r.status_code == 200, path
    assert httpx.get(srv.base_url + "/", timeout=TIMEOUT).headers["content-type"].startswith(
        "text/html")   # GET / is still the chat page


def test_responses_input_tokens_counts_what_create_reports(srv: Any) -> None:
    body = {"model": "tiny", "instructions": "You are Codex.", "input": "Fix the bug.",
            "tools": CODEX_TOOLS}
    counted = oa(srv).responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    made = oa(srv).responses.create(max_output_tokens=1, **body)
    assert counted.input_tokens == made.usage.input_tokens
    assert oa(srv).responses.input_tokens.count(model="tiny", input="Hi").input_tokens \
        < counted.input_tokens


def test_responses_truncation_auto_drops_the_oldest_turns(srv: Any) -> None:
    items: list[dict[str, Any]] = []
    for turn in range(6):   # about 6 x 900 tokens: past tiny's 4096-token context
        items += [{"role": "user", "content": f"turn {turn}: " + "word " * 450},
                  {"role": "assistant", "content": "noted " * 450}]
    items.append({"role": "user", "content": "Summarise."})
    with pytest.raises(openai.BadRequestError) as info:
        oa(srv).responses.create(model="tiny", input=items, max_output_tokens=2)
    assert info.value.response.json()["error"]["code"] == "context_length_exceeded"
    raw = oa(srv).responses.with_raw_response.create(
        model="tiny", instructions="You are Codex.", input=items, max_output_tokens=2,
        truncation="auto")
    r = raw.parse()
    assert r.truncation == "auto" and r.usage.input_tokens < 4096
    assert "truncation auto: the " in raw.headers["x-pipeserve-warning"]
    assert "oldest turn(s) of the input were dropped" in raw.headers["x-pipeserve-warning"]


def test_reasoning_summary_is_echoed_and_named_as_not_produced(srv: Any) -> None:
    raw = oa(srv).responses.with_raw_response.create(
        model="tiny", input="Hi", max_output_tokens=2,
        reasoning={"effort": "low", "summary": "auto"})
    assert raw.parse().reasoning.summary == "auto"
    assert "reasoning.summary: this server writes no summary" in raw.headers["x-pipeserve-warning"]
    with pytest.raises(openai.BadRequestError) as info:
        oa(srv).responses.create(model="tiny", input="Hi", max_output_tokens=2,
                                 reasoning={"summary": "brief"})
    assert info.value.response.json()["error"]["param"] == "reasoning.summary"
