"""End to end: a model pool (`pool=example`: generated qwen3 and llama tiny models, each
engine in its own process) on a real `serve.py`, driven by the real `openai` and `anthropic`
SDKs and raw SSE. Routing by `model`, output equal to each model served alone, a kill -9 of
one engine process mid-stream, LRU eviction, idle unload, 404s and load timeouts. Every
request has a timeout; every wait loop is bounded."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import pytest

from prometheus_client import CollectorRegistry

from pipeserve.core.client import EngineState
from pipeserve.metrics import Metrics
from pipeserve.pool.members import compose_members
from pipeserve.pool.pool import ModelPool
from tests.conftest import make_config
from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

QWEN, LLAMA = "tiny-qwen3", "tiny-llama"
IDS = (QWEN, LLAMA)
TIMEOUT = 60.0
PROMPTS = {QWEN: "Tell me a story about a cat.", LLAMA: "Where are my keys? On the table."}


def chat(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, logit_bias=NO_EOS)
    assert r.model == model and r.choices[0].finish_reason == "length"
    return r.choices[0].message.content or ""


def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=TIMEOUT)


def message(client: anthropic.Anthropic, model: str, prompt: str) -> str:
    r = client.messages.create(model=model, max_tokens=10,
                               messages=[{"role": "user", "content": prompt}],
                               extra_body={"temperature": 0, "logit_bias": NO_EOS})
    assert r.model == model
    return "".join(b.text for b in r.content if b.type == "text")


def respond(client: openai.OpenAI, model: str, prompt: str) -> str:
    r = client.responses.create(model=model, input=prompt, max_output_tokens=10, temperature=0,
                                extra_body={"logit_bias": NO_EOS})
    assert r.model == model
    return r.output_text


def models(base_url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(base_url + "/v1/models", timeout=TIMEOUT)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def wait_state(base_url: str, model: str, state: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if models(base_url)[model]["state"] == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"{model} not {state} in {timeout_s} s: {models(base_url)[model]}")


def engine_pid(srv: Any, model: str) -> int:
    """The model's current engine process, from the pool's log line."""
    found = re.findall(rf"model {re.escape(model)}: engine process (\d+) started", srv.log())
    assert found, srv.log()
    return int(found[-1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def pool(server_factory: Any) -> Any:
    return server_factory("pool=example")


@pytest.fixture(scope="module")
def solo(server_factory: Any) -> dict[str, Any]:
    """Each model served alone, in-process (the single-model launch, unchanged)."""
    return {QWEN: server_factory("model.arch=qwen3", f"model.name={QWEN}"),
            LLAMA: server_factory("model.arch=llama", f"model.name={LLAMA}")}


def test_interleaved_requests_equal_each_model_alone(pool: Any, solo: dict[str, Any]) -> None:
    alone = {m: chat(sdk(solo[m].base_url), m, PROMPTS[m]) for m in IDS}
    assert alone[QWEN] != alone[LLAMA]   # two different models: routing is visible
    client = sdk(pool.base_url)
    results: dict[tuple[str, int], str] = {}

    def run(model: str, i: int) -> None:
        results[(model, i)] = chat(client, model, PROMPTS[model])

    threads = [threading.Thread(target=run, args=(m, i)) for i in range(3) for m in IDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == 6
    for (model, _), text in results.items():
        assert text == alone[model], model
    # the other protocols route by `model` too
    for m in IDS:
        assert message(claude(pool.base_url), m, PROMPTS[m]) == \
            message(claude(solo[m].base_url), m, PROMPTS[m])
        assert respond(client, m, PROMPTS[m]) == respond(sdk(solo[m].base_url), m, PROMPTS[m])
    # the reproducibility record names the model id
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert f"model={LLAMA}" in raw.headers["x-pipeserve-record"].split(";")
    assert raw.parse().usage.model_extra["pipeserve"]["model"] == LLAMA
    listed = models(pool.base_url)
    assert list(listed) == list(IDS) and all(listed[m]["loaded"] for m in IDS)
    health = httpx.get(pool.base_url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["model"] == {QWEN: "loaded", LLAMA: "loaded"}
    r = httpx.get(pool.base_url + "/v1/adapters", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["data"] == []
    assert all(listed[m]["loaded"] is True and listed[m]["state"] == "loaded" for m in IDS)
    # a model label on the request-level families, per model
    fams = metric_families(pool.base_url)
    for m in IDS:
        assert sample_value(fams, "pipeserve_requests", "pipeserve_requests_total",
                            model=m, endpoint="chat", outcome="ok") >= 3
        assert sample_value(fams, "pipeserve_generation_tokens",
                            "pipeserve_generation_tokens_total", model=m) >= 3 * 12
        assert sample_value(fams, "pipeserve_model_load", "pipeserve_model_load_total",
                            model=m, outcome="ok") == 1
        assert sample_value(fams, "pipeserve_model_resident", "pipeserve_model_resident",
                            model=m) == 1
    build = fams["pipeserve_build_info"].samples[0].labels
    assert build["model"] == ",".join(IDS) and build["config_hash"]


def test_unknown_model_is_a_404_naming_the_ids(pool: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        sdk(pool.base_url).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert all(m in err["message"] for m in IDS) and "gpt-4o" in err["message"]
    with pytest.raises(anthropic.NotFoundError) as a:
        claude(pool.base_url).messages.create(model="claude-x", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
    assert a.value.body["type"] == "error"
    assert a.value.body["error"]["type"] == "not_found_error"
    assert all(m in a.value.body["error"]["message"] for m in IDS)
    r = httpx.post(pool.base_url + "/v1/responses", json={"model": "nope", "input": "hi"},
                   timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(pool.base_url + "/v1/messages/count_tokens",
                   json={"model": LLAMA, "messages": [{"role": "user", "content": "hi"}]},
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def stream_chat(base_url: str, model: str, max_tokens: int, out: dict[str, Any],
                started: threading.Event) -> None:
    """Stream a greedy chat; `out` gets its text, its error event (if any) and whether it
    ended with [DONE]."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[model]}],
            "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS, "stream": True}
    text, out["error"], out["done"] = "", None, False
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for i, line in enumerate(r.iter_lines()):
            assert i < 20_000, "stream did not end"
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out["error"] = event["error"]
                continue
            text += "".join(c["delta"].get("content") or "" for c in event["choices"])
            if text:
                started.set()
    out["text"] = text


def test_kill_9_of_an_engine_fails_only_its_stream(pool: Any, solo: dict[str, Any]) -> None:
    alone = chat(sdk(solo[LLAMA].base_url), LLAMA, PROMPTS[LLAMA], max_tokens=400)
    victim = engine_pid(pool, QWEN)
    assert alive(victim)
    outs: dict[str, dict[str, Any]] = {QWEN: {}, LLAMA: {}}
    started = {m: threading.Event() for m in IDS}
    threads = {m: threading.Thread(target=stream_chat, args=(
        pool.base_url, m, 4000 if m == QWEN else 400, outs[m], started[m])) for m in IDS}
    for t in threads.values():
        t.start()
    assert started[QWEN].wait(TIMEOUT) and started[LLAMA].wait(TIMEOUT)
    os.kill(victim, signal.SIGKILL)
    for t in threads.values():
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads.values())
    # the killed model's stream ends with an error event that says what happened
    err = outs[QWEN]["error"]
    assert err is not None and err["code"] == "engine_exited", outs[QWEN]
    assert "exited" in err["message"] and "signal 9" in err["message"]
    # the other model's stream finished, every token as when served alone
    assert outs[LLAMA]["error"] is None and outs[LLAMA]["done"]
    assert outs[LLAMA]["text"] == alone
    assert models(pool.base_url)[QWEN]["state"] == "failed"
    # the next request to the killed model restarts its engine and succeeds
    assert chat(sdk(pool.base_url), QWEN, PROMPTS[QWEN]) == \
        chat(sdk(solo[QWEN].base_url), QWEN, PROMPTS[QWEN])
    assert engine_pid(pool, QWEN) != victim and not alive(victim)
    assert httpx.get(pool.base_url + "/health", timeout=TIMEOUT).status_code == 200
    fams = metric_families(pool.base_url)
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=QWEN, reason="exited") == 1


def test_max_resident_evicts_then_idle_unload_frees_the_process(server_factory: Any) -> None:
    srv = server_factory("pool=example", "pool.max_resident=1", "pool.idle_unload_s=3")
    client = sdk(srv.base_url)
    first = chat(client, QWEN, PROMPTS[QWEN])
    qwen_pid = engine_pid(srv, QWEN)
    chat(client, LLAMA, PROMPTS[LLAMA])          # evicts the least recently used: qwen3
    state = models(srv.base_url)
    assert state[QWEN]["state"] == "unloaded" and state[LLAMA]["loaded"]
    assert not alive(qwen_pid)
    llama_pid = engine_pid(srv, LLAMA)
    assert chat(client, QWEN, PROMPTS[QWEN]) == first   # reloaded (evicting llama): same output
    assert not alive(llama_pid) and engine_pid(srv, QWEN) != qwen_pid
    pid = engine_pid(srv, QWEN)
    rss = rss_bytes(pid)
    fams = metric_families(srv.base_url)
    active = sample_value(fams, "pipeserve_mlx_memory_bytes", "pipeserve_mlx_memory_bytes",
                          model=QWEN, kind="active")
    assert active > 0 and rss > 50e6   # its weights and KV, in a process of MLX + Python
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=QWEN, reason="lru") == 1
    assert sample_value(fams, "pipeserve_model_load", "pipeserve_model_load_total",
                        model=QWEN, outcome="ok") == 2
    # idle for pool.idle_unload_s: unloaded, its process (and all its memory) gone
    wait_state(srv.base_url, QWEN, "unloaded", timeout_s=20)
    deadline = time.monotonic() + 10   # unloaded at once; the process exits right after
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_mlx_memory_bytes", "pipeserve_mlx_memory_bytes",
                        model=QWEN, kind="active") == 0   # no engine process reports it
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=QWEN, reason="idle") == 1
    assert chat(client, QWEN, PROMPTS[QWEN]) == first   # and it loads again on demand


def test_a_request_before_the_pool_started_loads_the_default_once(model_cache: Path) -> None:
    """The listener takes requests before its ready hook starts the default model's load: a
    request that came first began that load, and the hook must not begin a second one (on a
    busy machine that second load evicted the first's engine, pool.max_resident=1, and the
    request found its model "loading": a 503)."""
    launch = ["pool=example", f"model.cache_dir={model_cache}", "pool.max_resident=1"]
    cfg = make_config(*launch)
    pool = ModelPool(cfg, compose_members(cfg, launch), SimpleNamespace(
        draining=False, metrics=Metrics(CollectorRegistry())), CollectorRegistry(), launch)

    async def main() -> tuple[Any, Any, list[int]]:
        try:
            first = asyncio.create_task(pool.context(None, pin=True))   # the default model
            await asyncio.sleep(0)   # it has begun the load
            pool.started({"version": "test"})
            m = await first
            engine = m.engine
            loads = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_load"]
            await asyncio.gather(*loads, return_exceptions=True)   # every load it began
            return m, engine, [x.num_loads for x in pool.members.values()]
        finally:
            pool.stop()
    m, engine, loads = asyncio.run(main())
    assert m.id == QWEN and m.engine is engine and engine.state is not EngineState.LOADING
    assert loads == [1, 0]


def test_a_load_timeout_is_a_protocol_shaped_error(server_factory: Any) -> None:
    srv = server_factory("pool=example", "pool.load_timeout_s=0.05")
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        sdk(srv.base_url).chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "model_load_timeout"
    assert "pool.load_timeout_s=0.05" in e.value.body["message"]
    with pytest.raises(anthropic.APIStatusError) as a:
        claude(srv.base_url).messages.create(model=QWEN, max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
    assert a.value.status_code == 503 and a.value.body["type"] == "error"
    assert "did not load within" in a.value.body["error"]["message"]
    assert time.monotonic() - t0 < 30   # nothing hangs
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_model_load", "pipeserve_model_load_total",
                        model=LLAMA, outcome="timeout") >= 1
    assert not any(m["loaded"] for m in models(srv.base_url).values())


def test_the_ssd_tier_survives_a_killed_engine(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory("pool=example", "cache=ssd", f"cache.ssd.dir={tmp_path}")
    prompt = "A long shared preamble about caches, disks and restarts. " * 30

    def complete() -> Any:
        return sdk(srv.base_url).completions.create(model=LLAMA, prompt=prompt, max_tokens=12,
                                                    temperature=0, logit_bias=NO_EOS)
    cold = complete()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    r = httpx.post(srv.base_url + "/admin/cache/flush", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["flushed"] is True
    os.kill(engine_pid(srv, LLAMA), signal.SIGKILL)
    wait_state(srv.base_url, LLAMA, "failed")
    warm = complete()   # a new engine process, the same SSD directory
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_prompt_cache_restores",
                        "pipeserve_prompt_cache_restores_total", model=LLAMA) == 1


def test_one_model_isolated_serves_as_in_process(server_factory: Any,
                                                 solo: dict[str, Any]) -> None:
    srv = server_factory("model.arch=llama", f"model.name={LLAMA}", "server.isolate=true")
    alone = chat(sdk(solo[LLAMA].base_url), LLAMA, PROMPTS[LLAMA])
    assert chat(sdk(srv.base_url), LLAMA, PROMPTS[LLAMA]) == alone
    r = sdk(srv.base_url).chat.completions.create(   # one model: `model` is not checked
        model="whatever", messages=[{"role": "user", "content": PROMPTS[LLAMA]}], max_tokens=12,
        temperature=0, logit_bias=NO_EOS)
    assert r.choices[0].message.content == alone and r.model == LLAMA
    assert [m["id"] for m in models(srv.base_url).values()] == [LLAMA]
    assert engine_pid(srv, LLAMA) != srv.proc.pid and alive(engine_pid(srv, LLAMA))


def test_pool_memory_keeps_the_resident_weights_under_it(server_factory: Any) -> None:
    # each tiny model holds ~0.4 MB of weights: 0.6 MB fits one of them, never both
    srv = server_factory("pool=example", "pool.memory_gb=0.0006")
    client = sdk(srv.base_url)
    first = chat(client, QWEN, PROMPTS[QWEN])
    chat(client, LLAMA, PROMPTS[LLAMA])   # its size is known once loaded: then qwen3 goes
    state = models(srv.base_url)
    assert state[LLAMA]["loaded"] and state[QWEN]["state"] == "unloaded"
    assert chat(client, QWEN, PROMPTS[QWEN]) == first   # known sizes: llama goes first
    state = models(srv.base_url)
    assert state[QWEN]["loaded"] and state[LLAMA]["state"] == "unloaded"
    fams = metric_families(srv.base_url)
    for m in IDS:
        assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                            model=m, reason="memory") == 1
        assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                            model=m, reason="lru") == 0


def test_a_model_that_fails_to_load_is_a_503_and_the_others_serve(server_factory: Any) -> None:
    srv = server_factory("pool=example",
                         f'pool.models.{LLAMA}.overrides=["model=tiny","model.path=/nonexistent"]')
    with pytest.raises(openai.InternalServerError) as e:
        sdk(srv.base_url).chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "model_load_failed"
    assert "ConfigError" in e.value.body["message"] and "/nonexistent" not in str(e.value.body)
    assert "model.path '/nonexistent'" in srv.log()   # the cause is in the server's log
    assert models(srv.base_url)[LLAMA]["state"] == "failed"
    assert chat(sdk(srv.base_url), QWEN, PROMPTS[QWEN])   # the other model serves
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_model_load", "pipeserve_model_load_total",
                        model=LLAMA, outcome="failed") == 1
