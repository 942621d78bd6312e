"""An engine that dies while serving, on a real serve.py with its engine on a thread of the
server (the default core). An engine loop dies only of an internal failure (a device lost
mid-step), so the death is a fault injection, as kill -9 is in other fault tests: the
scheduler's `_target_` slot loads tests/serve/engine_fault.py's DyingScheduler, the real
scheduler except that a request with seed DIE_SEED makes its next schedule() raise. The
model, the engine, the HTTP side and the process are real.

With server.exit_on_engine_death (the default) the requests in flight get their 503 (a stream,
an error event) and the server exits by itself with status 70 (ENGINE_DIED) for a supervisor
to start it again; with it false the server stays up and /health answers 503. With the engine
in its own process (server.isolate=true), that process exits 70 and the server starts a new one,
which serves. Every request has a timeout; every wait is bounded."""
from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from pipeserve.launch.checks import ENGINE_DIED
from tests.serve.engine_fault import DIE_SEED
from tests.serve.test_engine_process import _stream
from tests.serve.test_openai import NO_EOS
from tests.serve.test_pool import alive, engine_pid

TIMEOUT = 60.0
FAULT = "scheduler._target_=tests.serve.engine_fault.DyingScheduler"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "temperature": 0, "logit_bias": NO_EOS}


def _die(base_url: str) -> httpx.Response:
    """The request whose seed makes the engine loop die (it is in flight when it does)."""
    return httpx.post(base_url + "/v1/chat/completions", timeout=TIMEOUT,
                      json={**CHAT, "max_tokens": 8, "seed": DIE_SEED})


def _assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]   # OpenAI's shape
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "service_unavailable", error
    assert "retry when /health answers 200" in error["message"], error


def test_a_dead_engine_fails_what_is_in_flight_and_the_server_exits_70(
        server_factory: Any) -> None:
    s = server_factory(FAULT)
    streamed: dict[str, Any] = {}
    started = threading.Event()
    stream = threading.Thread(target=_stream, args=(s.base_url, streamed, started), daemon=True)
    stream.start()
    assert started.wait(TIMEOUT) and streamed["error"] is None
    _assert_503(_die(s.base_url))
    stream.join(TIMEOUT)
    assert not stream.is_alive(), "the stream hung after the engine died"
    err = streamed["error"]
    assert err is not None and err["type"] == "service_unavailable", streamed
    assert "retry when /health answers 200" in err["message"], err
    assert s.proc.wait(TIMEOUT) == ENGINE_DIED, s.log()[-4000:]
    log = s.log()
    assert "engine loop died" in log and "injected fault" in log, log[-4000:]
    assert f"the server exits with status {ENGINE_DIED}" in log, log[-4000:]
    # the stop does not ask a dead engine to flush the prompt cache, nor report that it failed to
    assert "NOT fully flushed" not in log and "not flushed, the engine died" in log, log[-4000:]


def test_with_exit_on_engine_death_false_the_server_stays_up_answering_503(
        server_factory: Any) -> None:
    s = server_factory(FAULT, "server.exit_on_engine_death=false")
    _assert_503(_die(s.base_url))
    # past the grace an exiting server would take, it still answers: /health 503 `dead`
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert s.proc.poll() is None, s.log()[-4000:]
        health = httpx.get(s.base_url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        time.sleep(0.5)
    r = httpx.post(s.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                   json={**CHAT, "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert "the server exits" not in s.log()
    assert s.stop() == 0   # SIGTERM: the drain's exit


def test_in_its_own_process_a_dead_engine_exits_70_and_is_restarted(
        server_factory: Any) -> None:
    """Before, the engine process stayed up with its loop dead: every request got 503 while
    /health answered 200, and nothing restarted it."""
    s = server_factory(FAULT, "server.isolate=true")
    victim = engine_pid(s, "tiny")
    streamed: dict[str, Any] = {}
    started = threading.Event()
    stream = threading.Thread(target=_stream, args=(s.base_url, streamed, started), daemon=True)
    stream.start()
    assert started.wait(TIMEOUT) and streamed["error"] is None
    r = _die(s.base_url)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    stream.join(TIMEOUT)
    assert not stream.is_alive(), "the stream hung after the engine died"
    assert streamed["error"] is not None, streamed
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "(exit code 70)" not in s.log():
        time.sleep(0.1)
    assert "(exit code 70)" in s.log(), s.log()[-4000:]
    # a new engine process serves; the server never stopped
    while time.monotonic() < deadline:
        if httpx.get(s.base_url + "/health", timeout=TIMEOUT).status_code == 200:
            break
        time.sleep(0.1)
    assert s.proc.poll() is None and not alive(victim), s.log()[-4000:]
    assert engine_pid(s, "tiny") != victim
    ok = httpx.post(s.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                    json={**CHAT, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
