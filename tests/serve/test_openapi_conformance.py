"""Every OpenAI response shape a real `serve.py` sends — chat, chat stream chunks, completions,
completions stream, responses, responses stream events, errors, the models list — validated
against the schemas of OpenAI's published OpenAPI document (vendored in tests/schemas/openai,
see its README), plus the behaviours the schema brought up: n > 1 choices, refusal: null,
logit_bias clamping; and streams that stream text in (almost) every chunk on a model whose
output is random bytes. Driven by raw HTTP/SSE and by the real `openai` SDK."""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from mlx_lm.utils import load_tokenizer

from pipeserve.markup.output import OutputMarkup
from pipeserve.model.tiny.text import CHAT_TEMPLATE, ensure_model
from pipeserve.stages.detokenize import Detokenize

MODEL = "tiny"
TIMEOUT = 60.0
NO_EOS = {"0": -100, "2": -100}   # <|endoftext|>, <|im_end|>: max_tokens is the only end
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
CALL_TOKENS = 64   # room for a whole call under the tool grammar
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
GEN_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_PROMPT = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                   "{%- if enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
                   "{%- endif %}")
DOC = json.loads((Path(__file__).resolve().parent.parent / "schemas" / "openai"
                  / "schemas.json").read_text())


# -- schema validation -----------------------------------------------------------------------
def _completion_chunk() -> dict[str, Any]:
    """The document says completions stream CreateCompletionResponse objects, but its
    finish_reason is a required non-null enum, and OpenAI's own stream sends null until
    the last chunk: the same schema with finish_reason nullable (that one change)."""
    schema = copy.deepcopy(DOC["components"]["schemas"]["CreateCompletionResponse"])
    choice = schema["properties"]["choices"]["items"]
    choice["properties"]["finish_reason"] = {"anyOf": [choice["properties"]["finish_reason"],
                                                       {"type": "null"}]}
    return schema


@lru_cache(maxsize=None)
def validator(name: str) -> Draft202012Validator:
    components = copy.deepcopy(DOC["components"])
    components["schemas"]["CreateCompletionStreamChunk"] = _completion_chunk()
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                 "components": components})


def conforms(name: str, body: Any) -> None:
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    detail = "\n".join(f"  at {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                       for e in errors[:8])
    assert not errors, f"{name} does not conform:\n{detail}\nbody: {json.dumps(body)[:1500]}"


@lru_cache(maxsize=None)
def event_schemas() -> dict[str, str]:
    """Responses stream event type → the name of its schema (ResponseStreamEvent's members)."""
    out: dict[str, str] = {}
    schemas = DOC["components"]["schemas"]
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[-1]
        for kind in schemas[name].get("properties", {}).get("type", {}).get("enum", []):
            out[kind] = name
    return out


def event_conforms(event: dict[str, Any]) -> None:
    name = event_schemas().get(event["type"])
    assert name is not None, f"event type {event['type']!r} is not in ResponseStreamEvent"
    conforms(name, event)
    conforms("ResponseStreamEvent", event)


def test_the_vendored_schemas_catch_what_this_server_once_got_wrong() -> None:
    """The checks have teeth: the shapes this server once got wrong fail validation."""
    message = {"role": "assistant", "content": "hi"}   # no refusal
    chat = {"id": "c", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "stop"}]}
    with pytest.raises(AssertionError, match="refusal"):
        conforms("CreateChatCompletionResponse", chat)
    conforms("CreateChatCompletionResponse",
             {**chat, "choices": [{**chat["choices"][0], "message": {**message, "refusal": None}}]})
    response = {"id": "r", "object": "response", "created_at": 1, "status": "in_progress",
                "model": MODEL, "output": [], "error": None, "incomplete_details": None,
                "instructions": None, "parallel_tool_calls": True, "tools": [],
                "tool_choice": "auto", "temperature": 1.0, "top_p": 1.0, "metadata": {}}
    conforms("Response", response)
    for bad in ({"user": None}, {"usage": None}):
        with pytest.raises(AssertionError):
            conforms("Response", {**response, **bad})


# -- servers and transport -------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for every shape: Qwen3-coder tool calls, a template that opens <think>
    when thinking is asked for (off by default)."""
    assert GEN_PROMPT in CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    path.write_text(CHAT_TEMPLATE.replace(GEN_PROMPT, THINKING_PROMPT))
    return server_factory("model.tool_call_format=qwen3_coder", f"model.chat_template={path}",
                          "model.enable_thinking=false")


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)


def post(srv: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=TIMEOUT)


def ok(srv: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(srv: Any, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(JSON events, SSE event names) of a streaming POST; ends in [DONE] or an event chain."""
    events, names = [], []
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        done = False
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
            assert len(events) < 10_000
    assert done or path == "/v1/responses"
    return events, names


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **kw}


def completion_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **kw}


# -- chat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {}, {"logprobs": True, "top_logprobs": 2}, {"n": 3, "temperature": 1.0, "seed": 5},
    {"reasoning_effort": "high"}, {"max_tokens": 1, "stop": ["a", "e", "o"]},
], ids=["plain", "logprobs", "n3", "reasoning", "stop"])
def test_chat_completion_conforms(srv: Any, extra: dict[str, Any]) -> None:
    body = ok(srv, "/v1/chat/completions", chat_body(**extra))
    conforms("CreateChatCompletionResponse", body)
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
    assert [c["index"] for c in body["choices"]] == list(range(extra.get("n", 1)))


def test_chat_tool_call_conforms(srv: Any) -> None:
    body = chat_body(tools=CHAT_TOOLS, max_tokens=CALL_TOKENS, parallel_tool_calls=False,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = ok(srv, "/v1/chat/completions", body)
    conforms("CreateChatCompletionResponse", out)
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    chunks, _ = sse(srv, "/v1/chat/completions", body)
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)


@pytest.mark.parametrize("extra", [
    {}, {"stream_options": {"include_usage": True}}, {"logprobs": True, "top_logprobs": 2},
    {"n": 2, "temperature": 1.0, "seed": 3, "stream_options": {"include_usage": True}},
    {"reasoning_effort": "low"},
], ids=["plain", "include_usage", "logprobs", "n2", "reasoning"])
def test_chat_stream_chunks_conform(srv: Any, extra: dict[str, Any]) -> None:
    chunks, _ = sse(srv, "/v1/chat/completions", chat_body(**extra))
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    n = extra.get("n", 1)
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {i: "length" for i in range(n)}
    if "stream_options" in extra:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8 * n


# -- completions -----------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {}, {"logprobs": 2}, {"echo": True}, {"n": 2, "temperature": 1.0, "seed": 9},
], ids=["plain", "logprobs", "echo", "n2"])
def test_completion_and_its_stream_conform(srv: Any, extra: dict[str, Any]) -> None:
    body = ok(srv, "/v1/completions", completion_body(**extra))
    conforms("CreateCompletionResponse", body)
    assert [c["index"] for c in body["choices"]] == list(range(extra.get("n", 1)))
    if extra.get("echo"):
        return   # echo is not a streaming option
    chunks, _ = sse(srv, "/v1/completions", completion_body(**extra))
    for chunk in chunks:
        conforms("CreateCompletionStreamChunk", chunk)


# -- responses -------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {}, {"instructions": "Be brief.", "user": "u-1", "metadata": {"k": "v"}},
    {"logit_bias": {"2": 100}}, {"reasoning": {"effort": "high"}},
], ids=["incomplete", "echoed-fields", "completed", "reasoning"])
def test_responses_and_their_events_conform(srv: Any, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **extra}
    out = ok(srv, "/v1/responses", body)
    conforms("Response", out)
    assert ("user" in out) == ("user" in extra)   # omitted, never null, when not given
    if "user" in extra:
        assert out["user"] == "u-1"
    stored = httpx.get(f"{srv.base_url}/v1/responses/{out['id']}", timeout=TIMEOUT)
    assert stored.status_code == 200
    conforms("Response", stored.json())
    events, names = sse(srv, "/v1/responses", body)
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        event_conforms(event)
    # NO_EOS: max_output_tokens ends it (incomplete) unless <|im_end|> is forced at once
    finished = "response.completed" if "logit_bias" in extra else "response.incomplete"
    assert events[-1]["type"] == finished and out["status"] == finished.split(".")[1]


def test_responses_function_call_conforms(srv: Any) -> None:
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": RESP_TOOLS,
            "max_output_tokens": CALL_TOKENS, "temperature": 0, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    out = ok(srv, "/v1/responses", body)
    conforms("Response", out)
    assert [item["type"] for item in out["output"]] == ["function_call"]
    events, _ = sse(srv, "/v1/responses", body)
    for event in events:
        event_conforms(event)


# -- errors and models -----------------------------------------------------------------------
@pytest.mark.parametrize("method, path, payload, status", [
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 500}, 400),
    # an n that no idle server can admit (max_batch + max_queue) is a 400, never a retryable 429
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 128}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/responses", {"model": MODEL, "input": []}, 400),
    ("GET", "/v1/responses/resp_nope", None, 404),
    ("DELETE", "/v1/responses/resp_nope", None, 404),
    ("GET", "/v1/nowhere", None, 404),
])
def test_errors_conform(srv: Any, method: str, path: str, payload: Any, status: int) -> None:
    kw: dict[str, Any] = ({"content": payload} if isinstance(payload, bytes) else
                          {"json": payload} if payload is not None else {})
    r = httpx.request(method, srv.base_url + path, timeout=TIMEOUT, **kw)
    assert r.status_code == status, r.text
    conforms("ErrorResponse", r.json())


def test_models_list_conforms(srv: Any, client: openai.OpenAI) -> None:
    r = httpx.get(srv.base_url + "/v1/models", timeout=TIMEOUT)
    conforms("ListModelsResponse", r.json())
    assert [m.id for m in client.models.list()] == [MODEL]


# -- n > 1 -----------------------------------------------------------------------------------
def test_n_choices_through_the_sdk(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 1.0,
          "extra_body": {"logit_bias": NO_EOS}}
    r = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3                      # each choice its own random stream
    assert r.usage.completion_tokens == 3 * 12
    again = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.message.content for c in again.choices] == texts   # seeds per choice: deterministic
    one = client.chat.completions.create(n=1, seed=11, **kw)
    assert one.choices[0].message.content == texts[0]            # choice 0 keeps the seed
    # the stream of the same request: chunks carry their index, texts agree per choice
    parts: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert [parts[i] for i in range(3)] == texts
    done = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=4,
                                     max_tokens=6, temperature=1.0,
                                     extra_body={"logit_bias": NO_EOS})
    assert [c.index for c in done.choices] == [0, 1] and done.usage.completion_tokens == 12
    assert done.choices[0].text != done.choices[1].text
    # n choices are n rows: more than even an idle server takes (max_batch running + the
    # queue) can never run, so it is a 400 naming n and the limit, not a retryable 429
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(n=128, **kw)
    assert "n is 128" in info.value.body["message"] and info.value.body["param"] == "n"
    assert "admission.max_queue 64" in info.value.body["message"]


def metric(srv: Any, name: str) -> float:
    text = httpx.get(srv.base_url + "/metrics", timeout=TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_n_choices_share_the_prompt_through_the_prompt_cache(srv: Any,
                                                              client: openai.OpenAI) -> None:
    words = " ".join(f"w{i}" for i in range(150))   # a prompt no other test sent
    before = metric(srv, "pipeserve_prompt_cache_hit_tokens_total")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}],
                                       n=4, max_tokens=3, temperature=0.7)
    hits = metric(srv, "pipeserve_prompt_cache_hit_tokens_total") - before
    assert len(r.choices) == 4
    assert hits >= 3 * (r.usage.prompt_tokens - 1)   # choices 1..3 prefill from choice 0's KV


# -- logit_bias ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def detok(model_cache: Path) -> Detokenize:
    tok = load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))
    return Detokenize(None, SimpleNamespace(tokenizer=tok), OutputMarkup())


def test_logit_bias_out_of_range_and_fractional_values_are_clamped(client: openai.OpenAI,
                                                                   detok: Detokenize) -> None:
    kw = {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0, "logprobs": True}

    def tokens(bias: dict[str, float]) -> list[bytes]:
        r = client.chat.completions.create(**kw, logit_bias={**NO_EOS, **bias})
        return [bytes(t.bytes) for t in r.choices[0].logprobs.content]

    plain = tokens({})
    greedy = [i for i in range(len(detok.tokenizer)) if detok.token_bytes(i) == plain[0]]
    # a benchmark client's -1e9 bans the token as -100 does (clamped), not a 400
    for value in (-1e9, -100.5):
        banned = tokens({str(i): value for i in greedy})
        assert banned == tokens({str(i): -100 for i in greedy}) and banned[0] != plain[0]
    forced = tokens({"42": 1e9})
    assert forced == tokens({"42": 100}) == [detok.token_bytes(42)] * 3
    assert tokens({"42": 0.5}) and tokens({"42": -7.25})   # fractional values are numbers too
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw, logit_bias={"42": "big"})
    assert info.value.body["param"] == "logit_bias" and "'big'" in info.value.body["message"]


# -- streams that stream ---------------------------------------------------------------------
def test_random_byte_output_streams_text_in_most_chunks(srv: Any, detok: Detokenize) -> None:
    """logit_bias confines the random model to the single-byte tokens 0x80-0xFF, so it writes
    random non-ASCII bytes, mostly invalid UTF-8 (one invalid byte used to hold back the rest
    of the stream). Text still flows chunk by chunk — a chunk
    waits only behind a lead byte whose continuation may still come — and the stream joins
    to the non-streamed text of the same seeded request."""
    high = {str(i): 100 for i in range(len(detok.tokenizer))
            if len(raw := detok.token_bytes(i)) == 1 and raw[0] >= 0x80}
    assert len(high) == 128
    n = 96
    body = chat_body(max_tokens=n, temperature=1.0, seed=7, logit_bias=high)
    chunks, _ = sse(srv, "/v1/chat/completions", body)
    tokens = [c["choices"][0]["delta"] for c in chunks if c["choices"]
              and not c["choices"][0]["finish_reason"] and "role" not in c["choices"][0]["delta"]]
    assert len(tokens) == n   # one chunk per token
    with_text = sum(1 for d in tokens if d.get("content"))
    assert with_text >= 0.5 * n, f"only {with_text} of {n} chunks carried text"
    streamed = "".join(d.get("content") or "" for d in tokens)
    whole = ok(srv, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert streamed == whole and "\ufffd" in whole
    body = completion_body(max_tokens=n, temperature=1.0, seed=7, logit_bias=high)
    comp, _ = sse(srv, "/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in comp if c["choices"]]
    assert sum(1 for t in texts if t) >= 0.5 * n
    assert "".join(texts) == ok(srv, "/v1/completions", body)["choices"][0]["text"]
