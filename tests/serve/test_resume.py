"""Resumable streams through a real server: every SSE frame carries `id:`; a stream cut at a
random frame and resumed with GET /v1/streams/{id} + Last-Event-ID (or ?after=N) is
byte-identical to an uncut one, for chat, completions, Responses and Anthropic; a resumable
stream outlives its client, a plain one is cancelled when its client leaves."""
from __future__ import annotations

import random
import re
import time
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

TIMEOUT = 60.0
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": 0,
                                      "logit_bias": NO_EOS}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                        "temperature": 0, "logit_bias": NO_EOS}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "Tell me a story.",
                                    "temperature": 0, "logit_bias": NO_EOS}),
    "messages": ("/v1/messages", {"model": "tiny", "messages": MESSAGES, "temperature": 0,
                                  "logit_bias": NO_EOS}),
}
LIMIT_FIELD = {"chat": "max_tokens", "completions": "max_tokens",
               "responses": "max_output_tokens", "messages": "max_tokens"}


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    # cache=off: a repeated prompt reads nothing from the cache, so an uncut run and a resumed
    # one report the same usage and their bytes can be compared whole
    return server_factory("cache=off", "server.stream_resume_s=30")


def body_of(kind: str, max_tokens: int, **extra: Any) -> tuple[str, dict[str, Any]]:
    path, body = BODIES[kind]
    return path, {**body, LIMIT_FIELD[kind]: max_tokens, "stream": True, **extra}


def frames(r: httpx.Response, limit: int | None = None) -> list[bytes]:
    """The SSE events of a response, each with its trailing blank line; keep-alive comments
    are left out. Stops after `limit` events (the caller then closes: a cut)."""
    out: list[bytes] = []
    buf = b""
    for piece in r.iter_raw():
        buf += piece
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            if not frame.startswith(b":"):
                out.append(frame + b"\n\n")
            if limit is not None and len(out) >= limit:
                return out
    assert not buf.strip(), buf
    return out


def frame_id(frame: bytes) -> int:
    m = re.match(rb"id: (\d+)\n", frame)
    assert m, frame
    return int(m.group(1))


def stream_id(frame: bytes) -> str:
    data = orjson.loads(frame.split(b"data: ", 1)[1])
    for key in ("id",):
        if isinstance(data.get(key), str):
            return data[key]
    inner = data.get("message") or data.get("response")
    return inner["id"]


def post(base: str, path: str, body: dict[str, Any], limit: int | None = None) -> list[bytes]:
    with httpx.stream("POST", base + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        return frames(r, limit)


def resume(base: str, sid: str, last: int | None = None,
           after: int | None = None) -> httpx.Response:
    headers = {"Last-Event-ID": str(last)} if last is not None else {}
    params = {"after": str(after)} if after is not None else {}
    return httpx.get(f"{base}/v1/streams/{sid}", headers=headers, params=params,
                     timeout=TIMEOUT)


def normalise(data: bytes, sid: str) -> bytes:
    """Bytes with the stream's own id and clock fields blanked (two runs differ only there)."""
    data = data.replace(sid.encode(), b"ID")
    data = re.sub(rb'"(created|created_at)":\d+', rb'"\1":0', data)
    return re.sub(rb'"(msg|item|rs)_[0-9a-f]+', rb'"\1_X', data)


@pytest.mark.parametrize("kind", list(BODIES))
def test_cut_and_resumed_stream_is_byte_identical(srv: Any, kind: str) -> None:
    path, body = body_of(kind, 12, stream_options={"resumable": True})
    uncut = post(srv.base_url, path, body)
    assert [frame_id(f) for f in uncut] == list(range(len(uncut)))   # every frame numbered
    cut_at = random.Random(kind).randrange(1, len(uncut) - 1)
    head = post(srv.base_url, path, body, limit=cut_at)
    sid = stream_id(head[0])
    # the client resumes from the last id it holds (header), or a peer from ?after=N
    with httpx.stream("GET", f"{srv.base_url}/v1/streams/{sid}",
                      headers={"Last-Event-ID": str(frame_id(head[-1]))}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        tail = frames(r)
    resumed = b"".join(head + tail)
    assert normalise(resumed, sid) == normalise(b"".join(uncut), stream_id(uncut[0]))
    # ?after=N is the same replay; without either, the whole stream
    again = resume(srv.base_url, sid, after=cut_at - 1)
    assert again.status_code == 200 and again.content == b"".join(tail)
    assert resume(srv.base_url, sid).content == resumed


def test_resumable_stream_outlives_its_client(srv: Any) -> None:
    """Cut after the first frame of a long generation: it runs on without a client, and the
    resumed stream has every token (length finish, usage equal to max_tokens)."""
    path, body = body_of("chat", 600, stream_options={"resumable": True, "include_usage": True})
    head = post(srv.base_url, path, body, limit=1)
    sid = stream_id(head[0])
    time.sleep(0.5)   # the server sees the disconnect while the generation runs (~1.5 s)
    r = resume(srv.base_url, sid, last=0)
    assert r.status_code == 200, r.text
    events = [orjson.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 600
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_stream_resumes", "pipeserve_stream_resumes_total",
                        outcome="ok") >= 1
    assert sample_value(fams, "pipeserve_stream_resume_bytes",
                        "pipeserve_stream_resume_bytes") > 0


def test_a_reader_past_the_end_never_renumbers_a_live_stream(srv: Any) -> None:
    """A resume that claims a frame the live stream has not sent is a 400, and leaves the log
    as it was: the owner's resume then reads every frame, numbered without a gap."""
    path, body = body_of("chat", 600, stream_options={"resumable": True})
    head = post(srv.base_url, path, body, limit=1)
    sid = stream_id(head[0])
    far = resume(srv.base_url, sid, last=10**17)
    assert far.status_code == 400, far.text
    assert "has sent up to frame" in far.json()["error"]["message"] or "ended at frame" in far.text
    r = resume(srv.base_url, sid, last=0)
    assert r.status_code == 200, r.text
    ids = [frame_id(f) for f in frames_of(r.content)]
    assert ids == list(range(1, len(ids) + 1)) and len(ids) > 600 // 8
    assert r.text.rstrip().endswith("data: [DONE]")


def frames_of(data: bytes) -> list[bytes]:
    return [f + b"\n\n" for f in data.split(b"\n\n") if f and not f.startswith(b":")]


def test_plain_stream_is_cancelled_when_its_client_leaves(srv: Any) -> None:
    path, body = body_of("completions", 4000)
    before = sample_value(metric_families(srv.base_url), "pipeserve_requests",
                          "pipeserve_requests_total", endpoint="completions", outcome="cancelled")
    sid = stream_id(post(srv.base_url, path, body, limit=1)[0])
    deadline = time.monotonic() + 20
    while resume(srv.base_url, sid, last=0).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)   # bounded: until the server has seen the disconnect
    r = resume(srv.base_url, sid, last=0)
    assert r.status_code == 404, r.text
    assert "cancelled when its client disconnected" in r.json()["error"]["message"]
    after = sample_value(metric_families(srv.base_url), "pipeserve_requests",
                         "pipeserve_requests_total", endpoint="completions", outcome="cancelled")
    assert after == before + 1


def test_sdks_read_streams_with_ids(srv: Any) -> None:
    """The official SDKs parse frames that carry `id:` (every stream now has them)."""
    chat = sdk(srv.base_url).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logit_bias=NO_EOS,
        stream=True)
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content is not None) >= 1
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    with client.messages.stream(model="tiny", max_tokens=5, messages=MESSAGES) as s:
        assert s.get_final_message().usage.output_tokens == 5


@pytest.mark.parametrize("query,status,needle", [
    ({"after": "x"}, 400, "after is 'x'"),
    ({"after": "-5"}, 400, "frame ids start at 0"),
    ({"after": "+2"}, 400, "after is '+2'"),      # int() takes these: ids are parsed strictly
    ({"after": "2_0"}, 400, "after is '2_0'"),
    ({"after": "10000000000000000000"}, 400, "decimal digits"),
    ({"after": "999999999999999999"}, 400, "ended at frame"),
])
def test_bad_resume_requests_name_the_field(srv: Any, query: dict[str, str], status: int,
                                            needle: str) -> None:
    path, body = body_of("chat", 3)
    sid = stream_id(post(srv.base_url, path, body)[0])
    r = httpx.get(f"{srv.base_url}/v1/streams/{sid}", params=query, timeout=TIMEOUT)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_unknown_stream_is_404_and_bad_option_400(srv: Any) -> None:
    r = httpx.get(f"{srv.base_url}/v1/streams/chatcmpl-nope", timeout=TIMEOUT)
    assert r.status_code == 404 and "unknown or expired" in r.json()["error"]["message"]
    path, body = body_of("messages", 3, stream_options={"resumable": "yes"})
    r = httpx.post(srv.base_url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "stream_options.resumable" in r.text, r.text


def test_responses_resume_the_openai_way(srv: Any) -> None:
    """OpenAI's own resume of a Responses stream, through the SDK: retrieve(id, stream=True,
    starting_after=N) continues at sequence_number N + 1 (a frame's id is its
    sequence_number)."""
    path, body = body_of("responses", 12, stream_options={"resumable": True})
    head = post(srv.base_url, path, body, limit=3)
    rid = stream_id(head[0])
    seqs = [orjson.loads(f.split(b"data: ", 1)[1])["sequence_number"] for f in head]
    assert seqs == [frame_id(f) for f in head] == [0, 1, 2]
    events = list(sdk(srv.base_url).responses.retrieve(rid, stream=True, starting_after=2))
    assert events[0].sequence_number == 3
    assert [e.sequence_number for e in events] == list(range(3, 3 + len(events)))
    assert events[-1].type == "response.incomplete"   # it ran to max_output_tokens
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 12
