"""Reliability end to end: on a real `serve.py` pool (two generated tiny
models, each engine in its own process) and a real single-model server, every pipe command is
answered under its own id however many run at once, and the errors that used to invite useless
retries (or hide a bad request) are 400s that name the limit; a pool member mounts its own
adapters over HTTP. Every request has a timeout; every wait is bounded."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.adapters.test_adapters import write_adapter
from tests.serve.test_openai import NO_EOS

QWEN, LLAMA = "tiny-qwen3", "tiny-llama"
IDS = (QWEN, LLAMA)
TIMEOUT = 30.0
KEY = "sekrit"


ADMIN = "adm"   # a short admin key: the run files must redact it, and only it
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def pool(server_factory: Any, tmp_path_factory: pytest.TempPathFactory,
         model_cache: Path) -> Any:
    """pool=example, every member with one adapter directory holding an adapter of
    tiny-llama's shapes (none mounted at launch)."""
    adapters = tmp_path_factory.mktemp("pool-adapters")
    write_adapter(adapters, "llama-lora", ensure_model("llama", cache_dir=model_cache), rank=4,
                  seed=3)
    srv = server_factory("pool=example", f"server.admin_key={ADMIN}",
                         f"model.adapter_dir={adapters}")
    for m in IDS:   # both engine processes up before the storm
        r = _chat(srv.base_url, m, max_tokens=2)
        assert r.status_code == 200, r.text
    return srv


def _chat(base_url: str, model: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
          **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=TIMEOUT)


def _stream_and_leave(base_url: str, model: str) -> int:
    """Open a long stream, read one chunk, hang up: the parent sends the child an abort."""
    body = {"model": model, "messages": [{"role": "user", "content": "Go on."}],
            "max_tokens": 2000, "logit_bias": NO_EOS, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        return r.status_code


# -- item 1: the pool's pipe ---------------------------------------------------------------
def test_concurrent_commands_of_every_kind_on_a_pool_are_all_answered(pool: Any) -> None:
    base = pool.base_url
    jobs: list[tuple[str, Any]] = []
    for _ in range(3):   # the storm: rounds of 20 concurrent flushes (both children)
        jobs += [("flush", lambda: httpx.post(base + "/admin/cache/flush", headers=ADMIN_AUTH,
                                              timeout=TIMEOUT)) for _ in range(20)]
    jobs += [("metrics", lambda: httpx.get(base + "/metrics", timeout=TIMEOUT))
             for _ in range(6)]
    for i, m in enumerate(IDS * 3):
        jobs.append((f"chat {m}", lambda m=m: _chat(base, m)))
        jobs.append((f"choice {m}", lambda m=m, i=i: _chat(
            base, m, max_tokens=8, guided_choice=[f"left{i}", f"right{i}"])))
        jobs.append((f"abort {m}", lambda m=m: _stream_and_leave(base, m)))
    with ThreadPoolExecutor(32) as ex:
        futures = [(what, ex.submit(fn)) for what, fn in jobs]
        results = [(what, f.result(timeout=2 * TIMEOUT)) for what, f in futures]
    for what, r in results:
        status = r if isinstance(r, int) else r.status_code
        assert status == 200, (what, r if isinstance(r, int) else r.text)
        if what == "flush":
            assert r.json()["flushed"] is True
        if what == "metrics":
            assert 'pipeserve_requests_total{' in r.text and f'model="{LLAMA}"' in r.text
        if what.startswith("choice"):
            text = r.json()["choices"][0]["message"]["content"]
            assert text.startswith(("left", "right")), text
    # afterwards nothing is left jammed: a new grammar, a scrape, a flush all answer
    r = _chat(base, QWEN, max_tokens=8, guided_choice=["fresh-a", "fresh-b"])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in (
        "fresh-a", "fresh-b")
    assert httpx.get(base + "/metrics", timeout=TIMEOUT).status_code == 200
    assert httpx.post(base + "/admin/cache/flush", headers=ADMIN_AUTH,
                      timeout=TIMEOUT).json()["flushed"] is True
    assert "replied" not in pool.log()   # no reply came under an id that was not waiting


@pytest.fixture(scope="module")
def single(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One model in-process, behind an API key (no admin key), with an adapter directory."""
    adapters = tmp_path_factory.mktemp("adapters")
    # a ChatML template that renders no tools (as the default SmolLM2's)
    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                        "<|im_start|>assistant\n{% endif %}")
    # grammar bounds raised so a compile that outlives its time cap fits inside them
    return server_factory(f"server.api_key={KEY}", f"model.adapter_dir={adapters}",
                          f"model.chat_template={template}",
                          "admission.grammar_timeout_s=0.5", "admission.max_guided_choices=40000",
                          "admission.max_grammar_bytes=1000000")


AUTH = {"Authorization": f"Bearer {KEY}"}


# -- item 4: errors that invited useless retries ---------------------------------------------
def test_an_overlong_adapter_id_is_a_400_naming_the_limit(single: Any) -> None:
    url = single.base_url + "/v1/adapters"
    r = httpx.post(url, json={"id": "a" * 256}, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "id" and "256 bytes" in err["message"] and "255" in err["message"]
    r = httpx.post(url, json={"id": "é" * 128}, headers=AUTH, timeout=TIMEOUT)   # 256 bytes
    assert r.status_code == 400 and "256 bytes" in r.json()["error"]["message"]
    r = httpx.post(url, json={"id": "a" * 255}, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"


def test_a_pool_member_mounts_its_own_adapters_over_http(pool: Any) -> None:
    """Hot-swap on a pool crosses to the engine process of the member `model` names: the
    adapter is that member's (listed, served as `<member>:<id>`), never another's."""
    url = pool.base_url + "/v1/adapters"
    r = httpx.post(url, json={"id": "llama-lora", "model": LLAMA}, headers=ADMIN_AUTH,
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["id"] == "llama-lora", r.text
    listed = httpx.get(url, timeout=TIMEOUT).json()["data"]
    assert [(a["id"], a["model"], a["rank"]) for a in listed] == [("llama-lora", LLAMA, 4)]
    models = httpx.get(pool.base_url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [m["id"] for m in models] == [QWEN, LLAMA, f"{LLAMA}:llama-lora"]

    def text(model: str, **extra: Any) -> str:
        r = _chat(pool.base_url, model, max_tokens=8, logit_bias=NO_EOS, **extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    tuned = text(f"{LLAMA}:llama-lora")
    assert tuned == text(LLAMA, adapter="llama-lora") != text(LLAMA)
    r = _chat(pool.base_url, f"{QWEN}:llama-lora")   # the other member mounts none
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    assert r.json()["error"]["param"] == "model" and "mounted: none" in r.json()["error"]["message"]
    r = httpx.delete(url + "/llama-lora", params={"model": QWEN}, headers=ADMIN_AUTH,
                     timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["param"] == "id"
    r = httpx.delete(url + "/llama-lora", params={"model": "nope"}, headers=ADMIN_AUTH,
                     timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.delete(url + "/llama-lora", params={"model": LLAMA}, headers=ADMIN_AUTH,
                     timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert httpx.get(url, timeout=TIMEOUT).json()["data"] == []
    assert _chat(pool.base_url, f"{LLAMA}:llama-lora").status_code == 404


def test_an_n_no_idle_server_can_admit_is_a_400_naming_n(single: Any) -> None:
    r = _chat(single.base_url, "tiny", headers=AUTH, n=100, temperature=1.0)
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "n_over_limit"
    assert "n is 100" in err["message"] and "admission.max_queue 64" in err["message"]
    r = _chat(single.base_url, "tiny", headers=AUTH, n=3, temperature=1.0)   # one that fits runs
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


# -- item 5: admin routes are guarded by the API key when no admin key is set ------------------
def test_admin_routes_take_the_api_key_without_an_admin_key(single: Any) -> None:
    flush = single.base_url + "/admin/cache/flush"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": KEY[:-1]}):
        r = httpx.post(flush, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401, (headers, r.text)
        assert "server.api_key" in r.json()["error"]["message"]
    for headers in (AUTH, {"x-api-key": KEY}):
        r = httpx.post(flush, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["flushed"] is True
    r = httpx.post(single.base_url + "/v1/adapters", json={"id": "x"}, timeout=TIMEOUT)
    assert r.status_code == 401


# -- item 2: grammar compiles are bounded ----------------------------------------------------
def _timed(fn: Any) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    r = fn()
    return time.monotonic() - t0, r


def test_huge_constraints_are_refused_fast_while_a_small_one_compiles(single: Any) -> None:
    base = single.base_url

    def choice(items: list[str]) -> Any:
        return lambda: _chat(base, "tiny", headers=AUTH, max_tokens=12, guided_choice=items)
    huge = [f"option number {i}" for i in range(200_000)]            # 3.6 MB of choices
    many = [f"o{i}" for i in range(40_001)]                           # past the count limit
    slow = [f"choice number {i}" for i in range(39_000)]              # in bounds, slow to build
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(20):   # 41 levels of JSON: under the body's limit (64), over the schema's
        deep = {"type": "object", "properties": {"a": deep}}
    jobs = {"huge": choice(huge), "many": choice(many), "slow": choice(slow),
            "small": choice(["yes", "no"]),
            "deep": lambda: _chat(base, "tiny", headers=AUTH, guided_json=deep),
            "json": lambda: _chat(base, "tiny", headers=AUTH, max_tokens=6,
                                  response_format={"type": "json_object"}),
            "flush": lambda: httpx.post(base + "/admin/cache/flush", headers=AUTH,
                                        timeout=TIMEOUT)}
    with ThreadPoolExecutor(len(jobs)) as ex:
        futures = {k: ex.submit(_timed, fn) for k, fn in jobs.items()}
        got = {k: f.result(timeout=2 * TIMEOUT) for k, f in futures.items()}
    for name, limit in (("huge", "admission.max_grammar_bytes"),
                        ("many", "admission.max_guided_choices"),
                        ("deep", "admission.max_schema_depth"),
                        ("slow", "admission.grammar_timeout_s")):
        seconds, r = got[name]
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert limit in err["message"] and err["param"] in ("guided_choice", "guided_json"), err
        assert "panic" not in err["message"] and ".rs" not in err["message"]
        assert seconds < 10, (name, seconds)   # refused, never compiled for tens of seconds
    assert got["huge"][1].json()["error"]["code"] == "grammar_too_large"
    assert got["slow"][1].json()["error"]["code"] == "grammar_timeout"
    seconds, r = got["small"]
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert seconds < 10, seconds
    assert got["json"][1].status_code == 200 and got["flush"][1].status_code == 200
    # the same small constraint again comes from the cache of compiled grammars
    r = _chat(base, "tiny", headers=AUTH, max_tokens=12, guided_choice=["yes", "no"])
    assert r.status_code == 200


# -- item 3: large many-object bodies never hold the event loop ----------------------------
POLLER = r'''
import os, socket, sys, time
port, ready, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
worst, idle = 0.0, 0.0
s = socket.create_connection(("127.0.0.1", port), timeout=10)
req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
start = time.monotonic()
open(ready, "w").close()
while not os.path.exists(stop) and time.monotonic() - start < 60:
    t = time.monotonic()
    s.sendall(req)
    buf = b""
    while not buf.rstrip().endswith(b"}"):
        buf += s.recv(65536)
    lag = time.monotonic() - t
    if time.monotonic() - start < 0.5:
        idle = max(idle, lag)    # the first half second: no body yet
    else:
        worst = max(worst, lag)
    time.sleep(0.01)
print(f"{idle * 1000:.1f} {worst * 1000:.1f}")
'''
N = 80_000
BAD = {"role": "nobody", "content": "x"}   # the last item: refused once all are validated


def _tool_arguments_body() -> dict[str, Any]:
    args = json.dumps({"rows": [[i, [i, i]] for i in range(N // 2)]})
    return {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": args}}]}, BAD]}


LARGE_BODIES: dict[str, tuple[str, Any]] = {
    # rendered by the chat template and tokenized (then too long for the context)
    "messages": ("/v1/chat/completions", lambda: {
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * N}),
    "tool arguments": ("/v1/chat/completions", _tool_arguments_body),
    "anthropic": ("/v1/messages", lambda: {
        "model": "tiny", "max_tokens": 1,
        "messages": [{"role": "user", "content": "x"}] * N + [BAD]}),
    "responses": ("/v1/responses", lambda: {
        "model": "tiny", "max_output_tokens": 1,
        "input": [{"role": "user", "content": "x"}] * N + [BAD]}),
    "logit_bias": ("/v1/chat/completions", lambda: {
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
        "logit_bias": {str(i): 1 for i in range(2 * N)}}),
}


def _worst_health_ms(srv: Any, tmp_path: Any, path: str,
                     data: bytes) -> tuple[float, float, float]:
    """(idle, during, the request's own ms): an out-of-process poller (bounded: 60 s at most) times /health every
    10 ms while `data` is posted and answered (and for 0.3 s after: freeing it counts too)."""
    import subprocess
    import sys
    tmp_path.mkdir(parents=True, exist_ok=True)
    ready, stop = tmp_path / f"ready-{len(data)}", tmp_path / f"stop-{len(data)}"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(srv.port), str(ready),
                               str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = httpx.post(srv.base_url + path, content=data, timeout=120,
                       headers={**AUTH, "content-type": "application/json", "x-api-key": KEY})
        took = (time.perf_counter() - t0) * 1e3
        assert r.status_code in (200, 400), r.text[:300]
        time.sleep(0.3)
    finally:
        stop.touch()
        out, _ = poller.communicate(timeout=30)
    idle, worst = map(float, out.split())
    return idle, worst, took


@pytest.fixture(scope="module")
def one_string_ms(single: Any, tmp_path_factory: pytest.TempPathFactory) -> float:
    """The reference: the worst /health (or idle) time while a 3 MB one-string body is
    answered (which the loop always handled; what is left is the machine's own noise)."""
    text = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x " * 1_500_000}]}).encode()
    return max(_worst_health_ms(single, tmp_path_factory.mktemp("poll"),
                                "/v1/chat/completions", text)[:2])


@pytest.mark.parametrize("shape", list(LARGE_BODIES))
def test_health_answers_within_100_ms_during_a_large_body(single: Any, tmp_path: Any,
                                                          one_string_ms: float,
                                                          shape: str) -> None:
    """The issue's bound: /health under 100 ms while a body of many small objects is parsed,
    validated and answered — over the worst the same poller saw idle or during a one-string
    body (the machine's own scheduling noise, the same for every shape). A loop that parses
    on itself is slow every time and for most of the request; a busy machine's spike is
    neither: the best of three tries, and a stall under a quarter of the request's own time
    passes (a parse on the loop stalls /health for about all of it)."""
    path, make = LARGE_BODIES[shape]
    data = json.dumps(make()).encode()
    for attempt in range(3):
        idle, worst, took = _worst_health_ms(single, tmp_path / str(attempt), path, data)
        bound = max(100 + max(idle, one_string_ms), took / 4)
        if worst < bound:
            break
    assert worst < bound, (f"/health took {worst:.0f} ms during a {len(data) >> 20} MB {shape} "
                           f"body answered in {took:.0f} ms (one-string body: "
                           f"{one_string_ms:.0f} ms, idle {idle:.0f} ms)")


# -- item 7: small things ----------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_pool_401_names_the_pool_not_a_model_it_does_not_serve(pool: Any) -> None:
    r = httpx.post(pool.base_url + "/v1/adapters", json={"id": "x"}, timeout=TIMEOUT)
    assert r.status_code == 401
    fields = r.headers["x-pipeserve-record"].split(";")
    assert f"model={QWEN},{LLAMA}" in fields and "model=smollm2" not in fields


def test_a_short_key_is_redacted_and_nothing_else(pool: Any) -> None:
    hydra = (pool.log_path.parent / str(pool.port) / ".hydra" / "hydra.yaml").read_text()
    line = next(ln for ln in hydra.splitlines() if "override_dirname" in ln)
    assert "pool=example" in line and "server.admin_key=<redacted>" in line, line
    overrides = (pool.log_path.parent / str(pool.port) / ".hydra" / "overrides.yaml").read_text()
    assert "server.admin_key=<redacted>" in overrides and "pool=example" in overrides


def test_tools_a_template_cannot_render_are_named_in_a_header(single: Any, pool: Any) -> None:
    r = _chat(single.base_url, "tiny", headers=AUTH, tools=TOOLS)
    assert r.status_code == 200
    assert "tools ignored" in r.headers["x-pipeserve-warning"]
    assert "model.chat_template" in r.headers["x-pipeserve-warning"]
    r = _chat(single.base_url, "tiny", headers=AUTH, tools=TOOLS)
    assert "tools ignored" in r.headers["x-pipeserve-warning"]
    # and the log says it once, naming the model
    assert single.log().count("model tiny: request ") == 1
    assert "sent tools, but the chat template does not render tools" in single.log()
    r = _chat(single.base_url, "tiny", headers=AUTH, tools=TOOLS, tool_choice="none")
    assert "x-pipeserve-warning" not in r.headers   # not asked to render them
    r = _chat(single.base_url, "tiny", headers=AUTH)
    assert r.status_code == 200 and "x-pipeserve-warning" not in r.headers
    r = _chat(pool.base_url, QWEN, tools=TOOLS)   # a template that renders tools: no warning
    assert r.status_code == 200 and "x-pipeserve-warning" not in r.headers


def test_the_chat_page_cannot_be_framed(single: Any) -> None:
    r = httpx.get(single.base_url + "/", timeout=TIMEOUT)
    assert r.status_code == 200
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
