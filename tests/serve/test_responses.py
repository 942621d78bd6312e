"""End to end: OpenAI Responses on a real `serve.py`, driven by the real `openai` SDK
(`client.responses`) and raw SSE: bodies, the streaming event chain, previous_response_id
continuity, the store's TTL and byte cap, and errors. Every wait is bounded."""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

MODEL = "tiny"
TIMEOUT = 60.0
NO_EOS = {"0": -100, "2": -100}
ONLY_EOS = {"2": 100}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    """Request templates allowed: the reasoning-items test renders with one that keeps
    reasoning (tiny's own drops it)."""
    return server_factory("server.allow_request_templates=true")


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return sdk(server.base_url)


def create(client: openai.OpenAI, input: Any = "Tell me a story.", max_output_tokens: int = 10,
           bias: dict[str, int] | None = None, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, input=input, max_output_tokens=max_output_tokens,
                                   temperature=0,
                                   extra_body={"logit_bias": NO_EOS if bias is None else bias}, **kw)


def chat_prompt_tokens(client: openai.OpenAI, messages: list[dict[str, Any]]) -> int:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    return r.usage.prompt_tokens


def test_body_incomplete_at_max_output_tokens(client: openai.OpenAI) -> None:
    r = create(client, max_output_tokens=10)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage.output_tokens == 10 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 10
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.max_output_tokens == 10 and r.temperature == 0


def test_completed_when_the_model_ends_its_turn(client: openai.OpenAI) -> None:
    r = create(client, bias=ONLY_EOS)
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output_text == ""


def test_stream_event_chain(server: Any, client: openai.OpenAI) -> None:
    full = create(client, max_output_tokens=12)
    events = list(client.responses.create(model=MODEL, input="Tell me a story.",
                                          max_output_tokens=12, temperature=0, stream=True,
                                          extra_body={"logit_bias": NO_EOS}))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.incomplete"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    assert events[-4].text == text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12

    # raw SSE carries the same names in `event:` lines, and no [DONE]
    with httpx.stream("POST", server.base_url + "/v1/responses", timeout=TIMEOUT,
                      json={"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                            "stream": True}) as r:
        lines = [line for _, line in zip(range(1000), r.iter_lines()) if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] == "response.incomplete"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = create(client, input="Hello there", instructions="Be brief.")
    second = create(client, input="And then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # instructions are not carried over; the history is: user, assistant output, user
    history = [{"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == chat_prompt_tokens(client, history)
    assert first.usage.input_tokens == chat_prompt_tokens(
        client, [{"role": "system", "content": "Be brief."}, history[0]])
    third = create(client, input=[{"role": "user", "content": "Last one."}],
                   previous_response_id=second.id)
    assert third.usage.input_tokens == chat_prompt_tokens(
        client, history + [{"role": "assistant", "content": second.output_text},
                           {"role": "user", "content": "Last one."}])


def test_unknown_previous_id_is_404_and_store_false_is_not_kept(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        create(client, previous_response_id="resp_does_not_exist")
    err = info.value.response.json()["error"]
    assert err["param"] == "previous_response_id" and "resp_does_not_exist" in err["message"]
    assert err["code"] == "previous_response_not_found"
    kept = create(client, max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    gone = create(client, max_output_tokens=2, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=gone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_tool_items_round_trip(client: openai.OpenAI) -> None:
    plain = create(client, max_output_tokens=1)
    with_tools = create(client, max_output_tokens=1, tools=TOOLS)
    assert with_tools.usage.input_tokens > plain.usage.input_tokens
    assert with_tools.tools[0].name == "get_weather"
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    r = create(client, input=items, tools=TOOLS, max_output_tokens=4)
    assert r.usage.input_tokens > with_tools.usage.input_tokens
    assert r.status in ("incomplete", "completed")
    assert all(o.type in ("message", "function_call") for o in r.output)


# renders an assistant turn's reasoning_content as a think span, as Qwen3's template does
THINKING = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
            "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}"
            "{%- endif %}{{- (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_reasoning_items_render_as_the_assistant_turns_reasoning(server: Any) -> None:
    """A reasoning item sent back (ours: reasoning_text content; another's: a summary) is the
    next assistant turn's reasoning_content, the prompt a chat request with it renders; one
    with only encrypted_content adds nothing; a malformed one is a 400 naming input."""
    kwargs = {"chat_template": THINKING}
    thought = "The user greets me; greet back."

    def responses_tokens(reasoning: list[dict[str, Any]]) -> int:
        items = [{"role": "user", "content": "Hello"}, *reasoning,
                 {"type": "message", "role": "assistant", "content": "Hi there."},
                 {"role": "user", "content": "And again?"}]
        r = httpx.post(server.base_url + "/v1/responses/input_tokens", timeout=TIMEOUT, json={
            "model": MODEL, "input": items, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": MODEL, "max_tokens": 1, "chat_template_kwargs": kwargs, "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there.", "reasoning_content": thought},
            {"role": "user", "content": "And again?"}]}).json()["usage"]["prompt_tokens"]
    ours = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": thought}]}
    summary = {"type": "reasoning", "id": "rs_2",
               "summary": [{"type": "summary_text", "text": thought}]}
    sealed = {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "gAAA"}
    none = responses_tokens([])
    assert responses_tokens([ours]) == responses_tokens([summary]) == chat > none
    assert responses_tokens([sealed]) == none
    r = httpx.post(server.base_url + "/v1/responses", timeout=TIMEOUT, json={
        "model": MODEL, "input": [{"type": "reasoning", "content": "not parts"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "input[0].content must be an array" in r.json()["error"]["message"]


@pytest.mark.parametrize("fields, param", [
    ({"input": 42}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"temperature": 9}, "temperature"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "custom", "name": "x", "format": {"type": "grammar",
                                                           "syntax": "ebnf"}}]}, "tools"),
])
def test_bad_requests_are_openai_shaped_400s(client: openai.OpenAI, fields: dict[str, Any],
                                             param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=httpx.Response)
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_store_ttl_and_byte_cap(server_factory: Any) -> None:
    small = server_factory("server.responses_ttl_s=1", "server.responses_store_mb=0.006")
    client = sdk(small.base_url)
    ids = [create(client, max_output_tokens=2).id for _ in range(8)]
    client.responses.retrieve(ids[-1])
    with pytest.raises(openai.NotFoundError):   # the oldest went to keep under the byte cap
        client.responses.retrieve(ids[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.responses.retrieve(ids[-1])
        except openai.NotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a stored response outlived server.responses_ttl_s")
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=ids[-1])
