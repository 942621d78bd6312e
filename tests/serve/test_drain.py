"""Drain on SIGTERM with a real serve.py: the listener stays open, new requests get 503 with
Retry-After in their protocol's shape, /health answers 503 `draining`, the stream in flight
finishes completely and the process exits 0; past server.shutdown_timeout_s what is left is
cut off, and the exit is still 0."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import orjson

from tests.serve.test_openai import NO_EOS

TIMEOUT = 60.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}]}


class Stream(threading.Thread):
    """One streamed chat completion read as raw SSE; records each data line as it comes."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = base_url + "/v1/chat/completions"
        self.body = {**CHAT, "max_tokens": max_tokens, "stream": True, "logit_bias": NO_EOS,
                     "stream_options": {"include_usage": True}}
        self.lines: list[bytes] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=TIMEOUT) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:].encode())
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()

    def chunks(self) -> list[dict[str, Any]]:
        return [orjson.loads(x) for x in self.lines if x != b"[DONE]"]


def sigterm(s: Any) -> None:
    os.kill(s.proc.pid, signal.SIGTERM)


def test_sigterm_drains_with_the_listener_open(server_factory: Any) -> None:
    s = server_factory("server.shutdown_timeout_s=60")
    stream = Stream(s.base_url, max_tokens=1200)
    stream.start()
    assert stream.started.wait(TIMEOUT) and stream.error is None
    sigterm(s)
    t0 = time.monotonic()
    deadline = t0 + 10
    while True:   # the signal is handled at once; poll until /health says so (bounded)
        health = httpx.get(s.base_url + "/health", timeout=TIMEOUT)
        if health.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert health.status_code == 503
    assert health.json()["status"] == "draining" and health.json()["inflight"] == 1

    chat = httpx.post(s.base_url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                      timeout=TIMEOUT)
    assert chat.status_code == 503 and int(chat.headers["retry-after"]) > 0
    error = chat.json()["error"]   # OpenAI's shape
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]

    msg = httpx.post(s.base_url + "/v1/messages", timeout=TIMEOUT, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert msg.status_code == 503 and int(msg.headers["retry-after"]) > 0
    body = msg.json()              # Anthropic's shape
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert "shutting down" in body["error"]["message"]

    models = httpx.get(s.base_url + "/v1/models", timeout=TIMEOUT)
    assert models.status_code == 503 and "retry-after" in models.headers
    # all of that was answered while the stream was still running
    assert stream.is_alive() and s.proc.poll() is None, "the stream ended before the checks"
    assert httpx.get(s.base_url + "/metrics", timeout=TIMEOUT).status_code == 200

    stream.join(TIMEOUT)
    assert not stream.is_alive() and stream.error is None and stream.status == 200
    assert stream.lines[-1] == b"[DONE]"
    chunks = stream.chunks()
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]
            if ch.get("finish_reason")] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 1200
    assert s.proc.wait(TIMEOUT) == 0
    log = s.log()
    assert "SIGTERM: draining; 1 request(s) in flight" in log
    assert "drained: no request in flight" in log and "cut off" not in log


def test_past_the_timeout_what_is_left_is_cut_off(server_factory: Any) -> None:
    s = server_factory("server.shutdown_timeout_s=1")
    stream = Stream(s.base_url, max_tokens=3900)
    stream.start()
    assert stream.started.wait(TIMEOUT) and stream.error is None
    t0 = time.monotonic()
    sigterm(s)
    assert s.proc.wait(TIMEOUT) == 0
    took = time.monotonic() - t0
    stream.join(TIMEOUT)
    assert not stream.is_alive()
    assert b"[DONE]" not in stream.lines      # cut off, not finished
    assert 1 <= took < 15, took
    log = s.log()
    assert "drain timeout: 1 request(s) still in flight after 1 s" in log
    assert "shutdown timeout: 1 request(s) were cut off" in log
