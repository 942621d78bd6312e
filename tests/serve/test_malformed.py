"""Malformed input end to end: wrong types and structure nested past the limit are 400s in
the protocol's error shape naming the field, on every generation endpoint; a sweep that puts a
value of each JSON type in every place of valid bodies gets no 5xx and no exception text."""
from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MAX_DEPTH = 64   # pipeserve.http.api.fields.MAX_DEPTH
HI = [{"role": "user", "content": "hi"}]
LEAKS = ("Error(", "Traceback", "object is not", "maximum recursion", "line 1 column")


def nested(levels: int) -> str:
    """A JSON schema whose objects nest `levels` properties deep (2 containers per level)."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def deep_args(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory()


CASES = [  # (name, path, raw JSON body, the param named, a piece of the message)
    ("tool_calls is 5", "/v1/chat/completions",
     json.dumps({"messages": HI + [{"role": "assistant", "content": "x", "tool_calls": 5}]}),
     "messages", "messages[1].tool_calls must be an array"),
    ("tool_calls is true", "/v1/chat/completions",
     json.dumps({"messages": HI + [{"role": "assistant", "content": "x", "tool_calls": True}]}),
     "messages", "messages[1].tool_calls must be an array"),
    ("tool call arguments are 5", "/v1/chat/completions",
     json.dumps({"messages": HI + [{"role": "assistant", "tool_calls": [
         {"type": "function", "function": {"name": "f", "arguments": 5}}]}]}),
     "messages", "function.arguments must be a JSON object"),
    ("guided_json of 5,000 [", "/v1/chat/completions",
     json.dumps({"messages": HI, "guided_json": "[" * 5000}), "guided_json", "deeper than 64"),
    ("guided_json nested 900", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"guided_json":%s}' % nested(450),
     "guided_json", "deeper than 64"),
    ("response_format schema nested 900", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema",'
     '"json_schema":{"name":"n","schema":%s}}}' % nested(450), "response_format",
     "response_format.json_schema.schema nests"),
    ("tool parameters nested 900", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
     '{"name":"f","parameters":%s}}]}' % nested(450), "tools", "tools[0].parameters nests"),
    ("tool call arguments nested 900", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"type":'
     '"function","function":{"name":"f","arguments":%s}}]}]}' % json.dumps(deep_args(900)),
     "messages", "deeper than 64"),
    ("completions guided_json of 5,000 [", "/v1/completions",
     json.dumps({"prompt": "x", "guided_json": "[" * 5000}), "guided_json", "deeper than 64"),
    ("anthropic input_schema nested 900", "/v1/messages",
     '{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"tools":'
     '[{"name":"f","input_schema":%s}]}' % nested(450), None, "tools[0].input_schema nests"),
    ("anthropic tool_use input nested 900", "/v1/messages",
     '{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"},{"role":'
     '"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":%s}]}]}'
     % deep_args(900), None, "messages[1].content[0].input nests"),
    ("anthropic tool_choice type is a list", "/v1/messages",
     json.dumps({"model": "m", "max_tokens": 4, "messages": HI, "tool_choice": {"type": []}}),
     None, "tool_choice.type is []"),
    ("count_tokens tool_use input nested 900", "/v1/messages/count_tokens",
     '{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":'
     '[{"type":"tool_use","id":"t","name":"f","input":%s}]}]}' % deep_args(900), None,
     "deeper than 64"),
    ("responses tool parameters nested 900", "/v1/responses",
     '{"model":"m","input":"hi","tools":[{"type":"function","name":"f","parameters":%s}]}'
     % nested(450), "tools", "tools[0].parameters nests"),
    ("responses function_call arguments nested 900", "/v1/responses",
     json.dumps({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                          "arguments": deep_args(900)}]}),
     "input", "input[0].arguments nests"),
    ("responses function_call arguments not an object", "/v1/responses",
     json.dumps({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                          "arguments": "[1]"}]}), "input", "must hold a JSON object"),
    ("responses metadata nested 300", "/v1/responses",
     '{"model":"m","input":"hi","metadata":%s}' % deep_args(300), "metadata", "metadata nests"),
    ("seed past 2^64", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"seed":18446744073709551616}', "seed",
     "[0, 18446744073709551615]"),
]


@pytest.mark.parametrize("name,path,raw,param,message", CASES, ids=[c[0] for c in CASES])
def test_malformed_body_is_a_400_naming_the_field(server: Any, name: str, path: str, raw: str,
                                                  param: str | None, message: str) -> None:
    r = httpx.post(server.base_url + path, content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    if path.startswith("/v1/messages"):   # Anthropic's shape: no param, the field in the text
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        err = body["error"]
    else:
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert message in err["message"], err["message"]
    assert not any(leak in err["message"] for leak in LEAKS[:4]), err["message"]


def test_nesting_within_the_limit_still_works(server: Any) -> None:
    """A schema nested as deep as the limit allows compiles and renders: the limit does not
    cost a real client anything."""
    levels = MAX_DEPTH // 2 - 1   # two containers per level, plus the tool's own
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, content=(
        '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"tools":[{"type":'
        '"function","function":{"name":"f","parameters":%s}}]}' % nested(levels)))
    assert r.status_code == 200, r.text


# -- the sweep ---------------------------------------------------------------------------
CHAT = {"messages": [
    {"role": "system", "content": "s"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "r"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "tool_choice": "auto", "max_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "seed": 1, "stop": ["x"], "logit_bias": {"5": 1}, "logprobs": True, "top_logprobs": 2,
    "n": 1, "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
    "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
COMPLETIONS = {"prompt": "hi", "max_tokens": 1, "logprobs": 2, "echo": False, "best_of": 1,
               "guided_regex": "a+", "stop": "x", "n": 1}
MESSAGES = {"model": "m", "max_tokens": 1, "system": [{"type": "text", "text": "s"}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "t"}, {"type": "thinking", "thinking": "x"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "r"}]}]}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
            "stop_sequences": ["x"], "temperature": 0.5, "top_k": 3}
RESPONSES = {"model": "m", "instructions": "be", "max_output_tokens": 1,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "o"}]},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c1", "output": "r"}],
             "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
             "tool_choice": "auto", "reasoning": {"effort": "low"},
             "text": {"format": {"type": "json_object"}}, "metadata": {"k": "v"}, "store": False}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS,
          "/v1/messages": MESSAGES, "/v1/responses": RESPONSES}
# a number, a boolean, null, an array, an object, and an object nested 300 deep (strings are
# handled as numbers are wherever structure is expected)
VALUES = [5, True, None, [], {}, json.loads(deep_args(300))]


def places(obj: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if at:
        yield at
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for key, child in children:
        yield from places(child, at + (key,))


def replaced(obj: Any, at: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(obj)
    node = out
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = value
    return out


def test_every_place_of_every_type_gets_no_5xx_and_no_exception_text(server: Any) -> None:
    """Each value of VALUES in each place of a valid body (about 900 requests over chat,
    completions, messages and responses): each answer is a 200 or a 4xx in its protocol's
    shape, and no message carries exception text."""
    jobs = [(path, replaced(body, at, v)) for path, body in BODIES.items()
            for at in places(body) for v in VALUES]
    statuses: Counter[tuple[str, int]] = Counter()
    bad: list[tuple[str, Any, int, str]] = []

    async def run() -> None:
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for path, body in BODIES.items():   # the bases themselves are valid
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)

            async def one(path: str, body: Any) -> None:
                async with limit:
                    r = await http.post(path, json=body)
                statuses[(path, r.status_code)] += 1
                text = r.text
                shaped = (r.status_code == 200 or ("error" in r.json() and (
                    r.json().get("type") == "error" if path.startswith("/v1/messages")
                    else "message" in r.json()["error"])))
                if r.status_code >= 500 or not shaped or any(s in text for s in LEAKS[:4]):
                    bad.append((path, body, r.status_code, text[:300]))
            await asyncio.gather(*(one(p, b) for p, b in jobs))

    asyncio.run(asyncio.wait_for(run(), 300))
    assert not bad, bad[:5]
    assert sum(statuses.values()) == len(jobs) > 800
    for path in BODIES:   # both outcomes occur: the sweep reaches past the first check
        assert statuses[(path, 200)] and statuses[(path, 400)], statuses


def test_an_image_to_a_text_model_is_a_400_naming_the_part(server: Any) -> None:
    """model=tiny has no vision tower: an image part (OpenAI or Anthropic) is refused, by path."""
    url = "data:image/png;base64,iVBORw0KGgo="
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert r.status_code == 400
    assert "messages[0].content[1]" in r.json()["error"]["message"]
    assert "vision tower" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]})
    assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"]


def test_audio_and_video_parts_are_400s_naming_the_part(server: Any) -> None:
    for part in ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                 {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}):
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hear this"}, part]}]})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "messages[0].content[1]" in message and "modalities" in message
        if part["type"] == "input_audio":   # a text-only model: it says it has no audio tower
            assert "no audio tower and takes text only" in message
