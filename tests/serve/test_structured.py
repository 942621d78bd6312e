"""Structured output end to end: a real `serve.py` (continuous scheduler) driven by the openai
and anthropic SDKs and raw SSE. The tiny model's free text is gibberish, so every valid output
below is the grammar's doing. Constrained and free requests share batches; bad constraints
are 400s naming their field."""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from pipeserve.model.tiny.text import CHAT_TEMPLATE, ensure_model
from tests.serve.test_openai import (MESSAGES, NO_EOS, TIMEOUT, chat_text, completion_text,
                                     metric_families, sample_value, sdk, sse)
from tests.serve.test_tools_reasoning import GEN_PROMPT, THINKING_PROMPT

MODEL = "tiny"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "vip": {"type": "boolean"}},
          "required": ["name", "age", "pet", "vip"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CODE = r"[0-9]{3}-[a-z]{2}"
GBNF = 'root ::= "(" [a-z]{1,4} ("," [a-z]{1,4}){0,2} ")"'
GBNF_RE = r"\([a-z]{1,4}(,[a-z]{1,4}){0,2}\)"


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory("scheduler=continuous", "scheduler.max_batch=8")


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return sdk(srv.base_url)


@pytest.fixture(scope="module")
def closers(model_cache: Path) -> dict[str, float]:
    """logit_bias toward tokens holding `"` or `}`: the random model otherwise writes JSON
    strings that never end. The bias only helps the output finish; validity is the mask's."""
    tok = load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))
    ids = [i for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"}')]
    return {str(i): 5.0 for i in ids}


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **{"messages": MESSAGES, **kw})


# -- valid output, each kind ------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client: openai.OpenAI, temperature: float) -> None:
    r = chat(client, response_format=PERSON_FORMAT, max_tokens=300, temperature=temperature,
             seed=7)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_schema_100_samples_at_temperature_1_all_validate(srv: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 1.0,
            "response_format": PERSON_FORMAT}

    async def run() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(16)   # well under admission.max_queue
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
            async def one(seed: int) -> dict[str, Any]:
                async with gate:
                    r = await http.post("/v1/chat/completions", json={**body, "seed": seed})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]
            return await asyncio.gather(*(one(seed) for seed in range(100)))

    choices = asyncio.run(asyncio.wait_for(run(), 120))
    texts = set()
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        texts.add(choice["message"]["content"])
    assert len(texts) > 50   # sampled, not one answer repeated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_output_parses(client: openai.OpenAI, closers: dict[str, float],
                                   temperature: float) -> None:
    results = []
    for seed in range(4):
        r = chat(client, response_format={"type": "json_object"}, max_tokens=300,
                 temperature=temperature, seed=seed, logit_bias=closers)
        results.append(r.choices[0])
    finished = [c for c in results if c.finish_reason == "stop"]
    assert len(finished) >= 3
    for c in finished:
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_regex_and_grammar(client: openai.OpenAI, temperature: float) -> None:
    choices = ["red", "green", "blue", "not sure"]
    for seed in range(3):
        common = dict(max_tokens=64, temperature=temperature, seed=seed, logit_bias=NO_EOS)
        r = chat(client, extra_body={"guided_choice": choices}, **common)
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        r = chat(client, extra_body={"guided_regex": CODE}, **common)
        assert re.fullmatch(CODE, r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
        r = client.completions.create(model=MODEL, prompt="List:",
                                      extra_body={"guided_grammar": GBNF}, **common)
        assert re.fullmatch(GBNF_RE, r.choices[0].text), r.choices[0].text


def test_streaming_chat_and_completions(srv: Any) -> None:
    events, raw = sse(srv.base_url, "/v1/chat/completions",
                      {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0,
                       "response_format": PERSON_FORMAT})
    assert raw[-1] == "[DONE]"
    jsonschema.validate(json.loads(chat_text(events)), PERSON)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    events, _ = sse(srv.base_url, "/v1/completions",
                    {"model": MODEL, "prompt": "Code:", "max_tokens": 32, "temperature": 0.8,
                     "seed": 3, "guided_regex": CODE})
    assert re.fullmatch(CODE, completion_text(events))


def test_responses_text_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input="Who?", text={"format": fmt},
                                max_output_tokens=300, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input="Who?", text={"format": fmt},
                                 max_output_tokens=300, temperature=0.9) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_anthropic_messages_take_the_guided_fields(srv: Any) -> None:
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    m = client.messages.create(model=MODEL, max_tokens=32,
                               messages=[{"role": "user", "content": "Pick one"}],
                               extra_body={"guided_choice": ["alpha", "beta"], "temperature": 0})
    assert m.content[0].text in ("alpha", "beta") and m.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8,
                               messages=[{"role": "user", "content": "x"}],
                               extra_body={"guided_regex": "(?<=a)b"})
    assert "guided_regex" in info.value.response.json()["error"]["message"]


def test_thinking_is_off_for_constrained_requests_unless_asked(
        server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A template that opens <think> (thinking on by default): a constrained request renders
    with thinking off and its answer is the constrained output; asking to think as well gives
    the reasoning first and then the constrained answer (the grammar starts after the span); a
    client grammar, which cannot follow the span, is a 400."""
    path = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    path.write_text(CHAT_TEMPLATE.replace(GEN_PROMPT, THINKING_PROMPT))
    srv = server_factory(f"model.chat_template={path}", "model.enable_thinking=true")
    client = sdk(srv.base_url)
    r = chat(client, max_tokens=16, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    assert not (r.choices[0].message.model_extra or {}).get("reasoning_content")
    r = chat(client, max_tokens=24, temperature=0, reasoning_effort="high",
             extra_body={"guided_choice": ["yes", "no"], "max_reasoning_tokens": 6})
    assert r.choices[0].message.content in ("yes", "no")
    assert r.choices[0].message.model_extra["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 6 + 7   # + "</think>"'s tokens
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=16, reasoning_effort="high",
             extra_body={"guided_grammar": 'start: "yes" | "no"'})
    assert info.value.response.json()["error"]["param"] == "guided_grammar"


# -- batches ---------------------------------------------------------------------------------
def test_constrained_and_free_requests_share_a_batch(client: openai.OpenAI, srv: Any) -> None:
    free = [dict(messages=[{"role": "user", "content": f"Story number {i}"}], max_tokens=40,
                 temperature=0, logit_bias=NO_EOS) for i in range(3)]
    solo = [chat(client, **kw).choices[0].message.content for kw in free]
    constrained = [dict(messages=MESSAGES, max_tokens=300, temperature=t, seed=i,
                        response_format=PERSON_FORMAT) for i, t in enumerate((0.0, 0.7, 1.0))]
    constrained += [dict(messages=MESSAGES, max_tokens=40, temperature=0.5, seed=1,
                         extra_body={"guided_regex": CODE})]
    before = metric_families(srv.base_url)
    with ThreadPoolExecutor(len(free) + len(constrained)) as pool:
        jobs = [pool.submit(lambda kw=kw: client.chat.completions.create(model=MODEL, **kw))
                for kw in free + constrained]
        outs = [j.result(timeout=TIMEOUT).choices[0] for j in jobs]
    after = metric_families(srv.base_url)
    assert [o.message.content for o in outs[:len(free)]] == solo
    for o in outs[len(free):-1]:
        jsonschema.validate(json.loads(o.message.content), PERSON)
    assert re.fullmatch(CODE, outs[-1].message.content)

    def batched_steps(fams: dict[str, Any]) -> float:   # steps that ran more than one row
        return (sample_value(fams, "pipeserve_batch_size", "pipeserve_batch_size_count")
                - sample_value(fams, "pipeserve_batch_size", "pipeserve_batch_size_bucket",
                               le="1.0"))
    assert batched_steps(after) - batched_steps(before) > 20


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"guided_regex": "(?<=a)b"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= (", "guided_choice": ["a"]},
     "guided_grammar"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"not": {}}}}},
     "guided_json"),
    ("/v1/chat/completions", {"guided_choice": ["a"], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "guided_choice"),   # a required call is the whole answer: two constraints cannot both hold
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": {"$ref": "#/nowhere"}}}}, "text.format"),
])
def test_bad_constraints_are_400s_naming_the_field(srv: Any, path: str, fields: dict[str, Any],
                                                   param: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, **fields}
    if path == "/v1/chat/completions":
        body["messages"] = MESSAGES
    elif path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["input"] = "x"
    r = httpx.post(srv.base_url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"]
