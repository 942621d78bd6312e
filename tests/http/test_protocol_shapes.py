"""The HTTP side in-process, against a scripted engine (tests/http/scripted.py): what clients
see of each protocol — body shapes, SSE framing, usage, n > 1, stop strings, finish reasons,
errors in each protocol's shape — with no model and no server process. The real-server suite
(tests/serve/) keeps what only a process proves: the SDKs over a socket, kill -9, drain."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pipeserve.errors import EngineUnavailable
from tests.conftest import make_config
from tests.http.scripted import (InProcess, Reply, ScriptedEngine, data_of, sse_frames,
                                 tokenizer_side)

TEXT = "Hello there, friend."
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}]}
ORIGIN = "https://app.example"   # the one browser origin the module's server allows


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    cache = tmp_path_factory.mktemp("models")
    cfg = make_config(f"model.cache_dir={cache}", f"server.cors_origins=[{ORIGIN}]")
    app = InProcess(cfg, tokenizer_side(cfg))
    yield app
    app.close()


def run(setup: InProcess, scenario: Any, **engine: Any) -> tuple[Any, ScriptedEngine]:
    """`scenario(client)` against the app, its engine scripted by `engine` (script, waiting)."""
    return setup.run(scenario, **engine)


def num_tokens(setup: InProcess, text: str) -> int:
    return len(setup.model.tokenizer.encode(text, add_special_tokens=False))


def test_chat_body_has_openai_shape_and_usage(setup) -> None:
    async def scenario(client):
        return await client.post("/v1/chat/completions", json=CHAT)
    r, eng = run(setup, scenario)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {**choice["message"], "role": "assistant", "content": TEXT}
    usage = body["usage"]
    (req,) = eng.submitted
    assert usage["prompt_tokens"] == len(req.prompt_ids) > 0
    assert usage["completion_tokens"] == num_tokens(setup, TEXT)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_stream_frames_end_in_done_and_carry_usage(setup) -> None:
    async def scenario(client):
        return await client.post("/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True}})
    r, _ = run(setup, scenario)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.text)
    ids = [int(f["id"]) for f in frames if "data" in f]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)   # every frame resumable, in order
    payloads = data_of(frames)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert content == TEXT
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["stop"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == num_tokens(setup, TEXT)


def test_max_tokens_cuts_with_length(setup) -> None:
    async def scenario(client):
        return await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    r, _ = run(setup, scenario)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert TEXT.startswith(body["choices"][0]["message"]["content"])


def test_stop_string_ends_the_text_before_it_and_aborts_the_row(setup) -> None:
    async def scenario(client):
        plain = await client.post("/v1/chat/completions", json={**CHAT, "stop": ["friend"]})
        stream = await client.post("/v1/chat/completions",
                                   json={**CHAT, "stop": ["friend"], "stream": True})
        return plain, stream
    (plain, stream), eng = run(setup, scenario)
    choice = plain.json()["choices"][0]
    assert choice["message"]["content"] == "Hello there, " and choice["finish_reason"] == "stop"
    # the row ends before its Finished event: the record's batch size came with its tokens
    assert plain.json()["usage"]["pipeserve"]["batch_size"] == 1
    chunks = data_of(sse_frames(stream.text))[:-1]
    streamed = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert streamed == "Hello there, " and "friend" not in stream.text
    assert {r.request_id for r in eng.submitted} == set(eng.aborted)   # the rows are stopped


def test_n_choices_each_get_a_row_and_their_usage_adds_up(setup) -> None:
    replies = iter(["one two", "three", "four five six"])

    async def scenario(client):
        return await client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    r, eng = run(setup, scenario, script=lambda _req: Reply(next(replies)))
    body = r.json()
    assert len(eng.submitted) == 3
    by_index = {c["index"]: c["message"]["content"] for c in body["choices"]}
    assert sorted(by_index) == [0, 1, 2]
    assert sorted(by_index.values()) == sorted(["one two", "three", "four five six"])
    assert body["usage"]["completion_tokens"] == sum(
        num_tokens(setup, t) for t in ["one two", "three", "four five six"])
    assert body["usage"]["prompt_tokens"] == len(eng.submitted[0].prompt_ids)


def test_n_over_what_the_server_admits_is_refused_before_any_row(setup) -> None:
    async def scenario(client):
        return await client.post("/v1/chat/completions", json={**CHAT, "n": 1000})
    r, eng = run(setup, scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert eng.submitted == []


def test_a_full_queue_is_429_with_retry_after(setup) -> None:
    cap = setup.engine.cfg.admission.max_queue

    async def scenario(client):
        return await client.post("/v1/chat/completions", json=CHAT)
    r, eng = run(setup, scenario, waiting=cap)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and eng.submitted == []


def test_bad_sampling_value_is_400_naming_the_field_in_each_protocol(setup) -> None:
    async def scenario(client):
        oa = await client.post("/v1/chat/completions", json={**CHAT, "temperature": 9})
        an = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 8, "temperature": 9,
            "messages": [{"role": "user", "content": "Say hi."}]})
        return oa, an
    (oa, an), eng = run(setup, scenario)
    assert oa.status_code == 400 and oa.json()["error"]["param"] == "temperature"
    assert an.status_code == 400
    assert an.json()["type"] == "error" and "temperature" in an.json()["error"]["message"]
    assert eng.submitted == []


def test_an_engine_failure_reaches_the_client_as_503_or_an_error_event(setup) -> None:
    fail = Reply(error=EngineUnavailable("the engine stopped; retry", code="engine_exited"))

    async def scenario(client):
        plain = await client.post("/v1/chat/completions", json=CHAT)
        stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        return plain, stream
    (plain, stream), _ = run(setup, scenario, script=lambda _req: fail)
    assert plain.status_code == 503 and plain.headers.get("retry-after")
    assert plain.json()["error"]["code"] == "engine_exited"
    payloads = data_of(sse_frames(stream.text))
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert errors and errors[-1]["error"]["code"] == "engine_exited"


def test_anthropic_stream_has_the_full_event_sequence(setup) -> None:
    async def scenario(client):
        return await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "Say hi."}]})
    r, eng = run(setup, scenario)
    frames = sse_frames(r.text)
    names = [f["event"] for f in frames if "event" in f and f["event"] != "ping"]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names[1] == "content_block_start" and names[-3:-1] == ["content_block_stop",
                                                                 "message_delta"]
    assert set(names[2:-3]) == {"content_block_delta"}
    payloads = {f["event"]: data_of([f])[0] for f in frames if "event" in f}
    text = "".join(data_of([f])[0]["delta"]["text"] for f in frames
                   if f.get("event") == "content_block_delta")
    assert text == TEXT
    assert payloads["message_delta"]["delta"]["stop_reason"] == "end_turn"
    assert payloads["message_delta"]["usage"]["output_tokens"] == num_tokens(setup, TEXT)
    start = payloads["message_start"]["message"]
    assert start["usage"]["input_tokens"] == len(eng.submitted[0].prompt_ids)


def test_anthropic_body_and_completions_body(setup) -> None:
    async def scenario(client):
        msg = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 3,
            "messages": [{"role": "user", "content": "Say hi."}]})
        cmpl = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Once"})
        return msg, cmpl
    (msg, cmpl), _ = run(setup, scenario)
    m = msg.json()
    assert m["type"] == "message" and m["role"] == "assistant"
    assert m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == 3
    assert [b["type"] for b in m["content"]] == ["text"]
    c = cmpl.json()
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == TEXT
    assert c["choices"][0]["finish_reason"] == "stop"


def test_completions_prompt_of_token_ids_is_submitted_as_sent_and_bad_ids_are_400(setup) -> None:
    """A prompt of ids reaches the engine as sent; one with a bool or a float among them (or a
    list of such prompts) is refused naming `prompt`, and nothing is submitted for it."""
    ids = [5, 9, 2, 7] * 300

    async def scenario(client):
        good = await client.post("/v1/completions", json={"model": "tiny", "prompt": ids,
                                                          "max_tokens": 3})
        bad = [await client.post("/v1/completions", json={"model": "tiny", "prompt": p})
               for p in ([5, True, 7], [5, 9.0, 7], [[5, 9], [5, False]])]
        return good, bad
    (good, bad), eng = run(setup, scenario)
    assert good.status_code == 200, good.text
    (req,) = eng.submitted
    assert req.prompt_ids == ids and good.json()["usage"]["prompt_tokens"] == len(ids)
    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_health_reads_the_engines_published_load(setup) -> None:
    async def scenario(client):
        return await client.get("/health")
    r, _ = run(setup, scenario, waiting=3)
    assert r.status_code == 200
    assert r.json() == {**r.json(), "status": "ok", "waiting": 3, "inflight": 3}


def test_an_allowed_origin_gets_cors_headers_and_another_none(setup) -> None:
    """A browser page on server.cors_origins: its preflight is a 204 and its responses name
    the origin and expose pipeserve's headers; a page elsewhere gets no CORS header."""
    async def scenario(client):
        preflight = await client.options("/v1/chat/completions", headers={
            "origin": ORIGIN, "access-control-request-method": "POST"})
        return (preflight, await client.get("/v1/models", headers={"origin": ORIGIN}),
                await client.get("/v1/models", headers={"origin": "https://elsewhere.example"}))
    (preflight, allowed, other), _ = run(setup, scenario)
    assert preflight.status_code == 204
    for r in (preflight, allowed):
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-pipeserve-record" in r.headers["access-control-expose-headers"]
    assert other.status_code == 200
    assert not any(k.startswith("access-control") for k in other.headers)


def test_models_lists_the_published_context(setup) -> None:
    async def scenario(client):
        return await client.get("/v1/models/tiny")
    r, eng = run(setup, scenario)
    body = r.json()
    assert body["context_length"] == eng.limits.max_context and body["modalities"] == ["text"]
    assert body["loaded"] is True and body["state"] == "loaded"



def test_a_finished_stream_replays_after_last_event_id(setup) -> None:
    async def scenario(client):
        first = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        frames = [f for f in sse_frames(first.text) if "data" in f]
        sid = data_of(frames[:1])[0]["id"]
        cut = len(frames) // 2
        last = frames[cut - 1]["id"]
        again = await client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": last})
        return frames, cut, again
    (frames, cut, again), _ = run(setup, scenario)
    assert again.status_code == 200
    assert [f for f in sse_frames(again.text) if "data" in f] == frames[cut:]


def test_cached_prompt_tokens_reach_each_protocols_usage(setup) -> None:
    async def scenario(client):
        oa = await client.post("/v1/chat/completions", json=CHAT)
        an = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi."}]})
        return oa, an
    (oa, an), eng = run(setup, scenario, script=lambda _req: Reply(cached=3))
    usage = oa.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3
    assert usage["prompt_tokens"] == len(eng.submitted[0].prompt_ids)
    a = an.json()["usage"]
    assert a["cache_read_input_tokens"] == 3
    assert a["input_tokens"] + a["cache_read_input_tokens"] + a["cache_creation_input_tokens"] \
        == len(eng.submitted[1].prompt_ids)


def test_responses_stream_events_and_body(setup) -> None:
    body = {"model": "tiny", "input": "Say hi."}

    async def scenario(client):
        plain = await client.post("/v1/responses", json=body)
        stream = await client.post("/v1/responses", json={**body, "stream": True})
        return plain, stream
    (plain, stream), eng = run(setup, scenario)
    r = plain.json()
    assert r["object"] == "response" and r["status"] == "completed"
    (item,) = r["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == TEXT
    assert r["usage"]["output_tokens"] == num_tokens(setup, TEXT)
    assert r["usage"]["input_tokens"] == len(eng.submitted[0].prompt_ids)
    events = [e for e in data_of(sse_frames(stream.text)) if isinstance(e, dict)]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == TEXT and events[-1]["response"]["output"][0]["content"][0]["text"] == TEXT


def test_an_ended_stream_keeps_its_frames_and_not_its_request(setup) -> None:
    """A finished stream stays resumable for server.stream_resume_s, holding its frames only:
    not the request that made it (Sanic's request, its generation, through the producer
    task's or the expiry timer's context), which would otherwise live on for that minute, a
    few hundred objects a request for every full collection to walk."""
    import gc

    import sanic

    async def scenario(client):
        bodies = [(await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text
                  for _ in range(3)]
        sid = data_of(sse_frames(bodies[0]))[0]["id"]
        again = await client.get(f"/v1/streams/{sid}", params={"after": -1})
        return bodies, again
    (bodies, again), _ = run(setup, scenario)
    assert again.status_code == 200 and again.text == bodies[0]   # still resumable
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, sanic.Request)
            and o.path == "/v1/chat/completions"]
    assert live == [], f"{len(live)} finished chat requests still alive"
