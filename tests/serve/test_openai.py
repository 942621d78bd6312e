"""End to end: a real `serve.py` on 127.0.0.1, driven by the real `openai` SDK and by raw
httpx (SSE, malformed bodies), as users and generic clients do. Every request has a timeout
and every wait loop is bounded in count and time."""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
PROMPT = "Once upon a time, in a land far away,"
NO_EOS = {"0": -100, "2": -100}   # <|endoftext|>, <|im_end|>: makes max_tokens the only end
TIMEOUT = 60.0
API_KEY = "sekrit"


# -- helpers -----------------------------------------------------------------------------
def sdk(base_url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return sdk(server.base_url)


@pytest.fixture(scope="module")
def limited(server_factory: Any) -> Any:
    """One server for the limits: a queue of one, an API key, and a 1 kB body cap."""
    return server_factory("admission.max_queue=1", "scheduler.max_batch=1", f"server.api_key={API_KEY}",
                          "server.max_body_mb=0.001")


def sse(base_url: str, path: str, body: dict[str, Any],
        headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """POST a streaming request; returns (parsed JSON events, raw `data:` payloads in order)."""
    raw: list[str] = []
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, headers=headers,
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                raw.append(line[len("data: "):])
            if len(raw) > 10_000:
                raise AssertionError("stream did not end")
    events = [json.loads(d) for d in raw if d != "[DONE]"]
    return events, raw


def chat_text(events: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def completion_text(events: list[dict[str, Any]]) -> str:
    return "".join(c["text"] for e in events for c in e["choices"])


def metric_families(base_url: str) -> dict[str, Any]:
    r = httpx.get(base_url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample_value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    fam = fams.get(family)
    if fam is None:
        return 0.0
    return sum(s.value for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_health(base_url: str, timeout_s: float = 30.0, **want: int) -> dict[str, Any]:
    """Poll /health until every field in `want` has its value (bounded)."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    for _ in range(int(timeout_s / 0.05) + 1):
        body = httpx.get(base_url + "/health", timeout=10).json()
        if all(body.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return body


def greedy_chat(client: openai.OpenAI, max_tokens: int = 40, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                          temperature=0, logit_bias=NO_EOS, **kw)


def pick_stop(text: str) -> str:
    """A 3-character piece of `text` from around position 10, printable (no U+FFFD, not all
    spaces), so the stop string provably occurs in the greedy output."""
    for start in list(range(10, len(text) - 3)) + list(range(1, 10)):
        piece = text[start:start + 3]
        if "\ufffd" not in piece and piece.strip() and piece.isprintable():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


# -- chat / completions: bodies, streams, usage ---------------------------------------------
def test_chat_non_stream_length_and_usage(client: openai.OpenAI) -> None:
    r = greedy_chat(client, max_tokens=12)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_non_stream_length_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                  logit_bias=NO_EOS)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_ends_with_done(server: Any, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
            "logit_bias": NO_EOS}
    full = client.chat.completions.create(**body)
    events, raw = sse(server.base_url, "/v1/chat/completions", body)
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    streamed = chat_text(events)
    assert streamed == full.choices[0].message.content
    assert streamed
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    usage = last["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == full.usage.prompt_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completions_stream_matches_non_stream(server: Any, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
            "logit_bias": NO_EOS}
    full = client.completions.create(**body)
    events, raw = sse(server.base_url, "/v1/completions", body)
    assert raw[-1] == "[DONE]"
    assert completion_text(events) == full.choices[0].text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 20
    assert events[-1]["usage"]["total_tokens"] == full.usage.total_tokens


def test_stream_include_usage_final_chunk(server: Any, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}
    events, raw = sse(server.base_url, "/v1/chat/completions", body)
    assert raw[-1] == "[DONE]"
    final = events[-1]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 10
    assert final["usage"]["total_tokens"] == (final["usage"]["prompt_tokens"] + 10)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e.get("usage") is None for e in events[:-1])

    # the SDK's typed stream accepts the same chunks
    chunks = list(client.chat.completions.create(stream=True, **body))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_text(events)

    # completions: same OpenAI-style usage chunk
    cbody = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "temperature": 0,
             "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}
    cevents, craw = sse(server.base_url, "/v1/completions", cbody)
    assert craw[-1] == "[DONE]"
    assert cevents[-1]["choices"] == [] and cevents[-1]["usage"]["completion_tokens"] == 7


def test_max_tokens_exact_by_usage_and_logprobs(client: openai.OpenAI) -> None:
    for n in (1, 5, 33):
        r = greedy_chat(client, max_tokens=n, logprobs=True)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == n
        assert len(r.choices[0].logprobs.content) == n
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=17, temperature=0,
                                  logit_bias=NO_EOS, logprobs=0)
    assert c.usage.completion_tokens == 17
    assert len(c.choices[0].logprobs.tokens) == 17


# -- stop strings --------------------------------------------------------------------------
def test_stop_string_chat(server: Any, client: openai.OpenAI) -> None:
    base = greedy_chat(client, max_tokens=40).choices[0].message.content
    stop = pick_stop(base)
    expected = base[:base.index(stop)]

    r = greedy_chat(client, max_tokens=40, stop=[stop])
    text = r.choices[0].message.content
    assert stop not in text
    assert text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "logit_bias": NO_EOS, "stop": [stop]}
    events, raw = sse(server.base_url, "/v1/chat/completions", body)
    assert raw[-1] == "[DONE]"
    deltas = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    assert all(stop not in d for d in deltas)
    assert "".join(deltas) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_completions(server: Any, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                          "logit_bias": NO_EOS}
    base = client.completions.create(**kw).choices[0].text
    stop = pick_stop(base)
    r = client.completions.create(stop=stop, **kw)
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    events, _ = sse(server.base_url, "/v1/completions", {**kw, "stop": stop})
    assert completion_text(events) == base[:base.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


# -- seeds ---------------------------------------------------------------------------------
def test_seed_reproducible_and_seed_sensitive(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                           temperature=1.0, seed=seed, logit_bias=NO_EOS)
        assert r.usage.completion_tokens == 32
        return r.choices[0].message.content

    first, again = sample(123), sample(123)
    assert first == again
    others = [sample(s) for s in (7, 99, 2024)]
    assert any(o != first for o in others), "every seed gave the same text"


# -- logprobs ------------------------------------------------------------------------------
def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = greedy_chat(client, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for entry in content:
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        best = entry.top_logprobs[0]   # greedy picks the most likely token
        assert (best.token, best.bytes) == (entry.token, entry.bytes)
        assert best.logprob == pytest.approx(entry.logprob, abs=1e-4)
    # the raw body carries OpenAI's shape field for field
    assert r.choices[0].logprobs.refusal is None


def test_completions_legacy_logprobs_shape(client: openai.OpenAI) -> None:
    # this prompt's first greedy token is a lone byte piece whose runner-up decodes to the same
    # text ('\ufffd'): the dict must keep the likelier value, the one of the chosen token
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, logit_bias=NO_EOS, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(v <= 0 for v in lp.token_logprobs)
    for top, chosen, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert isinstance(top, dict) and 1 <= len(top) <= 2   # byte tokens may share a key
        assert all(v <= 0 for v in top.values())
        assert chosen in top   # greedy: the chosen token is the likeliest one
        assert top[chosen] == pytest.approx(value, abs=1e-4)
        assert max(top.values()) == pytest.approx(value, abs=1e-4)
    assert lp.text_offset[0] == 0
    for i in range(7):
        assert lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i])


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": 5}, "temperature", ["temperature", "2.0"]),
    ({"top_p": "x"}, "top_p", ["top_p"]),
    ({"max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ({"messages": []}, "messages", ["messages"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", ["robot"]),
    ({"n": 0}, "n", ["n", "[1, 128]"]),
    ({"top_logprobs": 3}, "top_logprobs", ["logprobs"]),
    ({"logit_bias": {"abc": 1}}, "logit_bias", ["logit_bias"]),
])
def test_bad_chat_fields_are_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any],
                                                  param: str, words: list[str]) -> None:
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw)
    e = info.value
    assert e.status_code == 400
    err = e.response.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert e.param == param and isinstance(e.body, dict) and e.body["param"] == param
    for w in words:
        assert w in err["message"]


def test_prompt_longer_than_context_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[65] * 4200, max_tokens=4)
    err = info.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "4096" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, logprobs=9)
    assert info.value.response.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("payload, words", [
    (b'{"model": "tiny", "messages": [', "JSON"),
    (b"not json at all", "JSON"),
    (b'[{"role": "user", "content": "hi"}]', "object"),
])
def test_malformed_bodies_are_400_json(server: Any, payload: bytes, words: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(server.base_url + path, content=payload,
                       headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 400
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert words in err["message"]


# -- models, health, metrics -----------------------------------------------------------------
def test_models_and_health(server: Any, client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    r = httpx.get(server.base_url + "/health", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_metrics_families_and_counters(server: Any, client: openai.OpenAI) -> None:
    # enough engine steps that the periodic memory sample has run at least once
    greedy_chat(client, max_tokens=300)
    before = metric_families(server.base_url)
    r = greedy_chat(client, max_tokens=6)
    after = metric_families(server.base_url)

    for name in ("pipeserve_requests", "pipeserve_queue_depth",
                 "pipeserve_time_to_first_token_seconds", "pipeserve_inter_token_latency_seconds",
                 "pipeserve_e2e_request_latency_seconds", "pipeserve_prompt_tokens",
                 "pipeserve_generation_tokens", "pipeserve_stage_seconds",
                 "pipeserve_mlx_memory_bytes"):
        assert name in after, name
    stages = {s.labels.get("stage") for s in after["pipeserve_stage_seconds"].samples}
    assert {"prefill", "sample"} <= stages
    kinds = {s.labels.get("kind") for s in after["pipeserve_mlx_memory_bytes"].samples}
    assert {"active", "cache", "peak"} <= kinds
    build = after.get("pipeserve_build") or after.get("pipeserve_build_info")
    assert build is not None, sorted(after)
    labels = build.samples[0].labels
    assert {"mlx_version", "device", "model", "config_hash"} <= set(labels)
    assert labels["model"] == MODEL
    # Sanic installs uvloop with itself: the server runs on it (GPU measurements once ran on
    # asyncio's loop because a hand-made install left it out)
    assert labels["event_loop"] == "uvloop", labels

    def delta(family: str, sample: str, **lab: str) -> float:
        return sample_value(after, family, sample, **lab) - sample_value(before, family, sample, **lab)

    assert delta("pipeserve_requests", "pipeserve_requests_total",
                 endpoint="chat", outcome="ok") == 1
    assert delta("pipeserve_generation_tokens", "pipeserve_generation_tokens_total") == 6
    assert delta("pipeserve_prompt_tokens", "pipeserve_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("pipeserve_e2e_request_latency_seconds",
                 "pipeserve_e2e_request_latency_seconds_count") == 1
    assert delta("pipeserve_time_to_first_token_seconds",
                 "pipeserve_time_to_first_token_seconds_count") == 1
    assert 1 <= delta("pipeserve_inter_token_latency_seconds",
                      "pipeserve_inter_token_latency_seconds_count") <= 5
    # the collector's pauses are timed: 300 tokens of one request allocate past gen 0's
    # threshold many times over
    pauses = {g: sample_value(after, "pipeserve_gc_pause_seconds",
                              "pipeserve_gc_pause_seconds_count", generation=g) for g in "012"}
    assert pauses["0"] >= 1, pauses
    assert sample_value(after, "pipeserve_gc_pause_seconds", "pipeserve_gc_pause_seconds_sum",
                        generation="0") > 0


# -- disconnects ---------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_engine(server: Any, client: openai.OpenAI) -> None:
    base = server.base_url
    assert wait_health(base, inflight=0)["inflight"] == 0
    before = metric_families(base)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3500, "temperature": 0,
            "logit_bias": NO_EOS, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break
        assert got >= 4
    # closed: the engine must drop the request, not run its 3500 tokens to the end
    t0 = time.monotonic()
    short = greedy_chat(client, max_tokens=5)
    assert short.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 30
    assert wait_health(base, 30, inflight=0, waiting=0)["inflight"] == 0
    after = metric_families(base)
    cancelled = (sample_value(after, "pipeserve_requests", "pipeserve_requests_total",
                              endpoint="chat", outcome="cancelled")
                 - sample_value(before, "pipeserve_requests", "pipeserve_requests_total",
                                endpoint="chat", outcome="cancelled"))
    assert cancelled == 1
    generated = (sample_value(after, "pipeserve_generation_tokens", "pipeserve_generation_tokens_total")
                 - sample_value(before, "pipeserve_generation_tokens", "pipeserve_generation_tokens_total"))
    assert generated < 2000, f"{generated} tokens generated: the abandoned stream kept running"


# -- limits: queue, API key, body size -----------------------------------------------------------
def test_queue_full_is_429_with_retry_after(limited: Any) -> None:
    base = limited.base_url
    auth = {"Authorization": f"Bearer {API_KEY}"}
    long_body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "temperature": 0,
                 "logit_bias": NO_EOS, "stream": True}
    with httpx.Client(base_url=base, headers=auth, timeout=TIMEOUT) as a, \
            httpx.Client(base_url=base, headers=auth, timeout=TIMEOUT) as b:
        with a.stream("POST", "/v1/chat/completions", json=long_body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            generating = False
            for _ in range(50):   # wait for generated content: the request is running
                line = next(lines)
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    generating = True
                    break
            assert generating
            assert wait_health(base, 10, inflight=1, waiting=0)["waiting"] == 0
            with b.stream("POST", "/v1/chat/completions", json=long_body) as queued:
                assert queued.status_code == 200
                assert wait_health(base, 10, waiting=1)["waiting"] == 1

                r = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=TIMEOUT,
                               json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
                assert r.status_code == 429
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error"
                assert set(err) >= {"message", "param", "code"}
                assert "queue" in err["message"]

                with pytest.raises(openai.RateLimitError) as info:
                    sdk(base, API_KEY).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
                assert info.value.status_code == 429
                assert info.value.response.headers.get("retry-after")
    # both long requests were abandoned: the server drains and serves again
    assert wait_health(base, 30, inflight=0, waiting=0) == {
        "status": "ok", "model": MODEL, "waiting": 0, "inflight": 0}
    r2 = sdk(base, API_KEY).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert r2.usage.completion_tokens >= 1


def test_api_key(limited: Any) -> None:
    base = limited.base_url
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(base, "wrong").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert info.value.status_code == 401
    assert info.value.response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        sdk(base, "wrong").models.list()
    r = httpx.post(base + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 401 and "error" in r.json()

    good = sdk(base, API_KEY)
    out = good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
    assert [m.id for m in good.models.list()] == [MODEL]
    h = httpx.get(base + "/health", timeout=TIMEOUT)
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_body_too_large_is_413_json(limited: Any) -> None:
    base = limited.base_url
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 3}
    r = httpx.post(base + "/v1/chat/completions", json=big, timeout=TIMEOUT,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "max_body_mb" in err["message"]
    with pytest.raises(openai.APIStatusError) as info:
        sdk(base, API_KEY).chat.completions.create(**big)
    assert info.value.status_code == 413
