"""End to end: one model with its engine core in its own process (`server.isolate=true`) on a
real `serve.py`, against the same model with the engine on a thread (the default). Output is
the same token for token (one request and a batch of concurrent ones); a stream read through
the SDK equals the whole answer; a client that leaves mid-stream frees its row in the core
process; a kill -9 of the core process ends the streams in flight with an error event and a
request in flight with a 503, /health fails until the core is back, and then it serves as
before. Every request has a timeout; every wait loop is bounded."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk
from tests.serve.test_pool import alive, engine_pid

MODEL = "tiny"
TIMEOUT = 60.0
PROMPTS = ["Tell me a story about a cat.", "Where are my keys? On the table.",
           "List three colors.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def thread_core(server_factory: Any) -> Any:
    return server_factory("model=tiny")


@pytest.fixture(scope="module")
def process_core(server_factory: Any) -> Any:
    return server_factory("model=tiny", "server.isolate=true", "server.cuda_graphs=false")


def chat(base_url: str, prompt: str, max_tokens: int = 24) -> Any:
    return sdk(base_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, logit_bias=NO_EOS, logprobs=True, top_logprobs=2)


def tokens(r: Any) -> list[tuple[str, float]]:
    return [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content]


def health(base_url: str) -> httpx.Response:
    return httpx.get(base_url + "/health", timeout=TIMEOUT)


def wait_health(base_url: str, status: int, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.05) + 1):
        r = health(base_url)
        if r.status_code == status or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == status, r.text
    return r.json()


def test_greedy_output_equals_the_thread_core_alone_and_batched(thread_core: Any,
                                                                  process_core: Any) -> None:
    alone = {p: chat(thread_core.base_url, p) for p in PROMPTS}
    for p in PROMPTS[:2]:   # one at a time
        r = chat(process_core.base_url, p)
        assert r.choices[0].message.content == alone[p].choices[0].message.content
        assert tokens(r) == tokens(alone[p])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == \
            (alone[p].usage.prompt_tokens, alone[p].usage.completion_tokens)
    with ThreadPoolExecutor(len(PROMPTS)) as ex:   # together: one batch in the core process
        together = list(ex.map(lambda p: chat(process_core.base_url, p), PROMPTS))
    for p, r in zip(PROMPTS, together):
        assert r.choices[0].message.content == alone[p].choices[0].message.content, p
    body = wait_health(process_core.base_url, 200)
    assert body["status"] == "ok" and body["inflight"] == 0
    assert engine_pid(process_core, MODEL) != process_core.proc.pid


def test_sdk_streams_equal_the_whole_answer(process_core: Any, thread_core: Any) -> None:
    whole = chat(thread_core.base_url, PROMPTS[0], 32).choices[0].message.content
    stream = sdk(process_core.base_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32,
        temperature=0, logit_bias=NO_EOS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32
    client = anthropic.Anthropic(base_url=process_core.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    with client.messages.stream(model=MODEL, max_tokens=32,
                                messages=[{"role": "user", "content": PROMPTS[0]}],
                                extra_body={"temperature": 0, "logit_bias": NO_EOS}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole and final.stop_reason == "max_tokens"
    # a stop string ends the row in the server process, before the core's finished event: the
    # record's batch size came across with the tokens
    stop = whole[8:12]
    r = sdk(process_core.base_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32,
        temperature=0, logit_bias=NO_EOS, stop=[stop])
    assert r.choices[0].message.content == whole[:whole.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.model_extra["pipeserve"]["batch_size"] >= 1


def test_a_client_leaving_mid_stream_frees_its_row(process_core: Any) -> None:
    base = process_core.base_url
    before = metric_families(base)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 3500, "temperature": 0, "logit_bias": NO_EOS, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break
        assert got >= 4
    # the core process drops the row: nothing in flight, no row running, far from 3500 tokens
    deadline = time.monotonic() + TIMEOUT
    for _ in range(2000):
        h = health(base).json()
        fams = metric_families(base)
        rows = sample_value(fams, "pipeserve_active_rows", "pipeserve_active_rows", model=MODEL)
        if (h["inflight"], rows) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (h["inflight"], h["waiting"], rows) == (0, 0, 0), (h, rows)
    made = (sample_value(fams, "pipeserve_generation_tokens", "pipeserve_generation_tokens_total")
            - sample_value(before, "pipeserve_generation_tokens",
                           "pipeserve_generation_tokens_total"))
    assert made < 2000, f"{made} tokens generated: the abandoned row kept running"
    assert chat(base, PROMPTS[1], 5).choices[0].finish_reason == "length"


def test_the_engine_process_runs_with_mlxs_cuda_graphs_as_configured(process_core: Any) -> None:
    """server.cuda_graphs=false: serve.py sets MLX_USE_CUDA_GRAPHS=0 before MLX loads, and the
    engine's own process inherits it (on a GPU its bursts of new batch shapes build no graphs)."""
    environ = open(f"/proc/{engine_pid(process_core, MODEL)}/environ", "rb").read().split(b"\0")
    assert b"MLX_USE_CUDA_GRAPHS=0" in environ, sorted(e[:40] for e in environ)


def test_the_collectors_pauses_of_both_processes_are_in_metrics(process_core: Any) -> None:
    """The engine process times its collector's pauses as the server does its own: /metrics
    has both, the engine's under the model's label, the server's under model="" (before, the
    engine's family was there and empty, and the server's was dropped)."""
    base = process_core.base_url
    assert chat(base, PROMPTS[2], 300).choices[0].finish_reason == "length"
    fams = metric_families(base)
    counted = {s.labels.get("model"): s.value for s in fams["pipeserve_gc_pause_seconds"].samples
               if s.name == "pipeserve_gc_pause_seconds_count" and s.labels["generation"] == "0"}
    assert counted.get(MODEL, 0) >= 1 and counted.get("", 0) >= 1, counted


def _stream(base_url: str, out: dict[str, Any], started: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 4000, "temperature": 0, "logit_bias": NO_EOS, "stream": True}
    out["error"], out["done"] = None, False
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      timeout=TIMEOUT) as r:
        for i, line in enumerate(r.iter_lines()):
            assert i < 20_000, "stream did not end"
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                out["error"] = event.get("error", out["error"])
                started.set()


def _whole(base_url: str, out: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 4000, "temperature": 0, "logit_bias": NO_EOS}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    out["status"], out["body"] = r.status_code, r.json()


def test_kill_9_of_the_core_fails_what_is_in_flight_and_health_until_it_is_back(
        server_factory: Any, thread_core: Any) -> None:
    srv = server_factory("model=tiny", "server.isolate=true")
    base = srv.base_url
    victim = engine_pid(srv, MODEL)
    streamed: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    started = threading.Event()
    threads = [threading.Thread(target=_stream, args=(base, streamed, started)),
               threading.Thread(target=_whole, args=(base, whole))]
    # the stream first, then the whole request once the stream is running: both in flight
    # (each has thousands of tokens to go) when the core is killed
    threads[0].start()
    assert started.wait(TIMEOUT)
    threads[1].start()
    inflight = _wait_inflight(base, 2)
    assert inflight == 2 and "status" not in whole, (inflight, whole)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a request hung after the core died"
    # the stream ends with an error event naming what happened; the whole answer is a 503
    err = streamed["error"]
    assert err is not None and err["code"] == "engine_exited" and "signal 9" in err["message"]
    assert whole["status"] == 503, whole
    assert whole["body"]["error"]["code"] == "engine_exited"
    # from the moment the server saw the core exit until the new one has loaded, /health
    # fails (dead, then loading); then it is back by itself, no request needed to restart it
    seen = _health_until_back(srv)
    assert seen[0][0] == 503 and {s for _, s in seen[:-1]} <= {"dead", "loading"}, seen
    assert seen[-1] == (200, "ok") and not alive(victim)
    assert f"model {MODEL}: restarting its engine process" in srv.log()
    assert engine_pid(srv, MODEL) != victim
    assert chat(base, PROMPTS[2]).choices[0].message.content == \
        chat(thread_core.base_url, PROMPTS[2]).choices[0].message.content
    fams = metric_families(base)
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=MODEL, reason="exited") == 1


def _wait_inflight(base_url: str, n: int) -> int:
    """/health's in-flight count once it reaches n (bounded: what it was at the deadline)."""
    deadline = time.monotonic() + TIMEOUT
    for _ in range(2400):
        inflight = health(base_url).json().get("inflight", 0)
        if inflight >= n or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return inflight


def _health_until_back(srv: Any) -> list[tuple[int, str]]:
    """(status code, status) of /health from the logged exit of the core until it answers 200
    (a new core process takes seconds to spawn and load: the first answers come before)."""
    for _ in range(1200):
        if "exited (killed by signal 9)" in srv.log():
            break
        time.sleep(0.05)
    seen: list[tuple[int, str]] = []
    for _ in range(2400):
        r = health(srv.base_url)
        seen.append((r.status_code, r.json()["status"]))
        if r.status_code == 200:
            break
        time.sleep(0.05)
    return seen


def _stacks_after_sigusr1(srv: Any, pid: int, frame: str) -> str:
    """Signal `pid` and wait (bounded) for its stack dump to reach the server's log."""
    before = srv.log().count("most recent call first")
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = srv.log()
        if log.count("most recent call first") > before and frame in log:
            return log
        time.sleep(0.05)
    return srv.log()


@pytest.mark.parametrize("core", ["thread", "process"])
def test_sigusr1_dumps_every_thread_and_the_server_goes_on(core: str, thread_core: Any,
                                                          process_core: Any) -> None:
    """kill -USR1: the process writes each thread's stack to the log (the engine loop's too,
    in whichever process runs it) and keeps serving, token for token as before."""
    srv = thread_core if core == "thread" else process_core
    before = tokens(chat(srv.base_url, PROMPTS[0]))
    pid = srv.proc.pid if core == "thread" else engine_pid(srv, MODEL)
    log = _stacks_after_sigusr1(srv, pid, "in _loop")
    assert "most recent call first" in log and 'core/engine.py", line' in log, log[-3000:]
    assert srv.proc.poll() is None and alive(pid)
    assert tokens(chat(srv.base_url, PROMPTS[0])) == before
