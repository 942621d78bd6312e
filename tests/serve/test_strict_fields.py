"""End to end: request fields an endpoint does not implement. By default the request runs and
the response names them in `x-pipeserve-ignored` (counted in pipeserve_ignored_fields_total);
with server.strict_fields=true each is a 400 in the protocol's shape naming the field."""
from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serve.test_openai import metric_families, sample_value

MODEL = "tiny"
TIMEOUT = 60.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    ("/v1/chat/completions", CHAT, "prompt_logprobs", 1),
    ("/v1/chat/completions", CHAT, "modalities", ["text", "audio"]),
    ("/v1/chat/completions", CHAT, "top_a", 0.5),
    ("/v1/chat/completions", CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", CHAT, "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", CHAT, "min_tokens", 3),
    ("/v1/chat/completions", CHAT, "web_search_options", {}),
    ("/v1/completions", COMPLETION, "prompt_logprobs", 2),
    ("/v1/completions", COMPLETION, "ignore_eos", True),
    ("/v1/responses", RESPONSE, "include", ["reasoning.encrypted_content"]),
    ("/v1/responses", RESPONSE, "max_tool_calls", 3),
    ("/v1/messages", MESSAGE, "service_tier", "standard_only"),
    ("/v1/messages", MESSAGE, "made_up_field", 1),
]
IDS = [f"{path[4:].replace('/', '_')}-{name}" for path, _, name, _ in CASES]


@pytest.fixture(scope="module")
def lax(server_factory: Any) -> Any:
    return server_factory()


@pytest.fixture(scope="module")
def strict(server_factory: Any) -> Any:
    return server_factory("server.strict_fields=true")


@pytest.mark.parametrize("path, body, name, value", CASES, ids=IDS)
def test_unsupported_field_is_named_in_the_header(lax: Any, path: str, body: dict[str, Any],
                                                  name: str, value: Any) -> None:
    r = httpx.post(lax.base_url + path, json={**body, name: value}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["x-pipeserve-ignored"] == name


@pytest.mark.parametrize("path, body, name, value", CASES, ids=IDS)
def test_unsupported_field_is_a_400_in_strict_mode(strict: Any, path: str,
                                                   body: dict[str, Any], name: str,
                                                   value: Any) -> None:
    r = httpx.post(strict.base_url + path, json={**body, name: value}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert name in err["message"] and "server.strict_fields" in err["message"]
    if path != "/v1/messages":   # OpenAI's shape names the field; Anthropic's has no param
        assert err["param"] == name and err["code"] == "unsupported_field"
    else:
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"


def test_supported_fields_and_default_values_pass_strict_mode(strict: Any) -> None:
    client = openai.OpenAI(base_url=strict.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=2, temperature=0.5, top_p=0.9,
        seed=3, stop=["\n"], logprobs=True, top_logprobs=2, n=2, user="u1",
        modalities=["text"], parallel_tool_calls=True, frequency_penalty=0.1,
        extra_body={"priority": "batch", "deadline_ms": 600_000})   # admission reads both
    assert r.http_response.status_code == 200
    assert "x-pipeserve-ignored" not in r.headers
    claude = anthropic.Anthropic(base_url=strict.base_url, api_key="x", max_retries=0)
    m = claude.messages.create(model=MODEL, messages=MESSAGE["messages"], max_tokens=2,
                               metadata={"user_id": "u"}, stop_sequences=["\n\n"],
                               extra_body={"top_k": 5})
    assert m.type == "message"


@pytest.mark.parametrize("kind", ["lax", "strict"])
def test_parallel_tool_calls_false_is_honoured_and_reported_so(kind: str, request: Any) -> None:
    """It limits a turn to one call (tests/serve/test_tools_reasoning.py), so it is neither
    named as ignored nor refused in strict mode, and Responses echoes it as sent."""
    srv = request.getfixturevalue(kind)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=2, parallel_tool_calls=False)
    assert chat.http_response.status_code == 200
    assert "x-pipeserve-ignored" not in chat.headers
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, parallel_tool_calls=False)
    assert "x-pipeserve-ignored" not in raw.headers
    assert raw.parse().parallel_tool_calls is False
    assert client.responses.create(model=MODEL, input="hi",
                                   max_output_tokens=2).parallel_tool_calls is True


def test_ignored_fields_are_counted_by_endpoint_and_name(lax: Any) -> None:
    before = metric_families(lax.base_url)
    r = httpx.post(lax.base_url + "/v1/chat/completions",
                   json={**CHAT, "top_a": 1, "prompt_logprobs": 1, "zz_unknown": 1},
                   timeout=TIMEOUT)
    assert r.headers["x-pipeserve-ignored"] == "top_a, prompt_logprobs, zz_unknown"
    after = metric_families(lax.base_url)
    for field in ("top_a", "prompt_logprobs", "other"):
        def count(fams: dict[str, Any]) -> float:
            return sample_value(fams, "pipeserve_ignored_fields", "pipeserve_ignored_fields_total",
                                endpoint="chat", field=field)
        assert count(after) - count(before) == 1, field


def test_a_field_name_no_header_can_hold_is_counted_not_echoed(lax: Any) -> None:
    body = {**CHAT, "ok_name": 1, "bad\r\nx-evil: 1": 1, "café\x0b": 2}
    r = httpx.post(lax.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.headers["x-pipeserve-ignored"] == "ok_name, (+2 more)"
    assert "x-evil" not in r.headers
