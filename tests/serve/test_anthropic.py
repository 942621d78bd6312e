"""End to end: Anthropic Messages on a real `serve.py` (with an API key, sent as x-api-key),
driven by the real `anthropic` SDK and raw SSE. Every request has a timeout and every
stream read is bounded."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

MODEL = "tiny"
KEY = "sekrit"
TIMEOUT = 60.0
NO_EOS = {"0": -100, "2": -100}   # <|endoftext|>, <|im_end|>
ONLY_EOS = {"2": 100}             # <|im_end|> first: the turn ends at once
USER = [{"role": "user", "content": "Tell me a story about a cat."}]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]


def total_in(usage: Any) -> int:
    """All input tokens: Anthropic's input_tokens excludes those read from the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory(f"server.api_key={KEY}")


@pytest.fixture(scope="module")
def client(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0,
                               timeout=TIMEOUT)


def create(client: anthropic.Anthropic, max_tokens: int = 12, bias: dict[str, int] | None = None,
           sampling: dict[str, Any] | None = None, **kw: Any) -> Any:
    """Greedy by default. This SDK release has no sampling parameters, so temperature and
    our extensions travel in extra_body, as any field the SDK does not know would."""
    kw.setdefault("messages", USER)
    extra = {"temperature": 0, "logit_bias": NO_EOS if bias is None else bias, **(sampling or {})}
    return client.messages.create(model=MODEL, max_tokens=max_tokens, extra_body=extra, **kw)


def raw_events(srv: Any, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """POST a streaming request; (event name, data) pairs in order."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream("POST", srv.base_url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
            assert len(out) < 10_000, "stream did not end"
    return out


def test_message_body_usage_and_max_tokens(client: anthropic.Anthropic) -> None:
    m = create(client, max_tokens=12)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12 and total_in(m.usage) > 0
    assert m.usage.cache_read_input_tokens == 0


def test_end_turn(client: anthropic.Anthropic) -> None:
    m = create(client, max_tokens=12, bias=ONLY_EOS)
    assert m.stop_reason == "end_turn"
    assert m.content[0].text == ""


def test_stream_event_sequence_matches_non_stream(srv: Any, client: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "logit_bias": NO_EOS,
            "messages": USER}
    full = create(client, max_tokens=16)
    events = raw_events(srv, body)
    names = [n for n, _ in events if n != "ping"]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == (["message_start", "content_block_start"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    data = [d for n, d in events if n != "ping"]
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == total_in(full.usage)   # before the cache lookup
    assert data[1]["content_block"] == {"type": "text", "text": ""} and data[1]["index"] == 0
    text = "".join(d["delta"]["text"] for d in data[2:2 + deltas])
    assert all(d["delta"]["type"] == "text_delta" for d in data[2:2 + deltas])
    assert text == full.content[0].text
    final = data[-2]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 16

    with client.messages.stream(model=MODEL, max_tokens=16, messages=USER,
                                extra_body={"temperature": 0, "logit_bias": NO_EOS}) as stream:
        got = stream.get_final_message()
    assert got.content[0].text == text and got.stop_reason == "max_tokens"
    assert got.usage.output_tokens == 16


def test_stop_sequences(srv: Any, client: anthropic.Anthropic) -> None:
    base = create(client, max_tokens=40).content[0].text
    stop = next(base[i:i + 3] for i in range(10, len(base) - 3)
                if "\ufffd" not in base[i:i + 3] and base[i:i + 3].strip())
    m = create(client, max_tokens=40, stop_sequences=[stop])
    assert m.content[0].text == base[:base.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    events = raw_events(srv, {"model": MODEL, "max_tokens": 40, "temperature": 0,
                              "logit_bias": NO_EOS, "messages": USER, "stop_sequences": [stop]})
    delta = next(d for n, d in events if n == "message_delta")["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    streamed = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert streamed == m.content[0].text


def test_system_string_or_blocks_and_count_tokens(client: anthropic.Anthropic) -> None:
    as_string = create(client, max_tokens=1, system="You are terse. Answer briefly.")
    as_blocks = create(client, max_tokens=1, system=[
        {"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer briefly."}])
    plain = create(client, max_tokens=1)
    assert total_in(as_string.usage) > total_in(plain.usage)
    assert total_in(as_blocks.usage) > total_in(plain.usage)
    counted = client.messages.count_tokens(model=MODEL, messages=USER,
                                           system="You are terse. Answer briefly.")
    assert counted.input_tokens == total_in(as_string.usage)


def test_tools_render_and_tool_round_trip(client: anthropic.Anthropic) -> None:
    plain = create(client, max_tokens=1)
    with_tools = create(client, max_tokens=1, tools=TOOLS)
    assert total_in(with_tools.usage) > total_in(plain.usage)
    none = create(client, max_tokens=1, tools=TOOLS, tool_choice={"type": "none"})
    assert total_in(none.usage) == total_in(plain.usage)   # not rendered
    turns = USER + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"}]}]
    m = create(client, max_tokens=4, tools=TOOLS, messages=turns)
    assert total_in(m.usage) > total_in(with_tools.usage)
    assert m.stop_reason in ("max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS)
    assert counted.input_tokens == total_in(m.usage)


def test_thinking_param_and_sampling_extensions_are_accepted(client: anthropic.Anthropic) -> None:
    m = create(client, max_tokens=5, thinking={"type": "disabled"},
               sampling={"top_k": 5, "top_p": 0.9})
    assert m.usage.output_tokens == 5 and [b.type for b in m.content] == ["text"]
    seeded = [create(client, max_tokens=8, sampling={"temperature": 1.0, "seed": 7, "min_p": 0.05})
              for _ in range(2)]
    assert seeded[0].content[0].text == seeded[1].content[0].text


@pytest.mark.parametrize("body, words", [
    ({"messages": USER}, ["max_tokens", "required"]),
    ({"max_tokens": 4, "messages": []}, ["messages"]),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, ["role", "robot"]),
    ({"max_tokens": 4, "messages": USER, "temperature": 5}, ["temperature", "2.0"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     ["image", "text"]),
    ({"max_tokens": 4, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, ["nope", "get_weather"]),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}}, ["no tools"]),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "maybe"}}, ["thinking.type"]),
])
def test_bad_requests_are_anthropic_shaped_400s(srv: Any, client: anthropic.Anthropic,
                                                 body: dict[str, Any], words: list[str]) -> None:
    r = httpx.post(srv.base_url + "/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY}, timeout=TIMEOUT)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    for w in words:
        assert w in err["error"]["message"]
    if "max_tokens" in body:   # the SDK raises its typed error for the same body
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MODEL, **{k: v for k, v in body.items()
                                                   if k not in ("temperature",)},
                                   extra_body={k: v for k, v in body.items() if k == "temperature"})
        assert info.value.body["error"]["message"] == err["error"]["message"]


def test_auth_malformed_json_and_unknown_route_are_anthropic_shaped(srv: Any) -> None:
    wrong = anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0,
                                timeout=TIMEOUT)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=USER)
    assert info.value.response.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(srv.base_url + "/v1/messages", timeout=TIMEOUT,
                        headers={"authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "max_tokens": 2, "messages": USER})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    bad = httpx.post(srv.base_url + "/v1/messages", content=b'{"model": ', timeout=TIMEOUT,
                     headers={"x-api-key": KEY, "content-type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error" and "JSON" in bad.text
    missing = httpx.post(srv.base_url + "/v1/messages/batches", json={}, timeout=TIMEOUT,
                         headers={"x-api-key": KEY})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # the OpenAI routes keep OpenAI's shape on the same server
    oa = httpx.post(srv.base_url + "/v1/chat/completions", json={}, timeout=TIMEOUT,
                    headers={"x-api-key": KEY})
    assert oa.status_code == 400 and oa.json()["error"]["param"] == "messages"
