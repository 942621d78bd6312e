"""End to end: `serve.py model.adapter_dir=... model.adapter=<id>` as a real process —
GET /v1/adapters lists what is mounted (behind server.api_key like every /v1 route), the
reproducibility record names the adapter, and a bad adapter stops the launch with its reason.
Several adapters at launch, chosen per request, behave the same with the engine core in its
own process (server.isolate=true)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeserve.launch.checks import LAUNCH_ERROR
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import ROOT, free_port
from tests.adapters.test_adapters import write_adapter
from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sample_value

KEY = "adapter-key"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    write_adapter(root, "support-bot", ensure_model(cache_dir=model_cache), rank=4,
                  keys=["self_attn.q_proj", "self_attn.v_proj"])
    return root


def _completion(base_url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", headers=headers, timeout=TIMEOUT,
                      json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                            "temperature": 0, "logit_bias": NO_EOS})


def test_mounted_adapter_is_listed_and_recorded(server_factory: Any, adapter_dir: Path) -> None:
    s = server_factory(f"model.adapter_dir={adapter_dir}", "model.adapter=support-bot",
                       f"server.api_key={KEY}")
    assert httpx.get(s.base_url + "/v1/adapters", timeout=TIMEOUT).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(s.base_url + "/v1/adapters", headers=auth, timeout=TIMEOUT)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    mounted = body["data"][0]
    assert mounted["id"] == "support-bot" and mounted["rank"] == 4
    assert mounted["target_modules"] == ["self_attn.q_proj", "self_attn.v_proj"]
    assert mounted["bytes"] > 0 and mounted["fine_tune_type"] == "lora"
    done = _completion(s.base_url, auth)
    assert done.status_code == 200
    identity = f"support-bot@{mounted['digest']}"
    assert f"adapter={identity}" in done.headers["x-pipeserve-record"]
    assert done.json()["usage"]["pipeserve"]["adapter"] == identity


def test_no_adapter_lists_none(server: Any) -> None:
    r = httpx.get(server.base_url + "/v1/adapters", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"object": "list", "data": []}
    done = _completion(server.base_url, {})
    assert "adapter=" not in done.headers["x-pipeserve-record"]
    assert "adapter" not in done.json()["usage"]["pipeserve"]


def test_unknown_adapter_stops_the_launch(server_factory: Any, adapter_dir: Path) -> None:
    s = server_factory(f"model.adapter_dir={adapter_dir}", "model.adapter=nope", wait=False)
    assert s.proc.wait(120) != 0
    assert "model.adapter 'nope' is not in model.adapter_dir" in s.log()
    assert "adapters there: support-bot" in s.log()


# serve.py with one more startup listener that is still awaiting when the engine has already
# failed (as the batch runner's resume can be on a loaded machine)
SLOW_STARTUP = """
import asyncio, sys
import pipeserve.http.server as server
build = server.build_app
def build_app(*args, **kwargs):
    app = build(*args, **kwargs)
    @app.after_server_start
    async def _slow(app):
        await asyncio.sleep(4)
    return app
server.build_app = build_app
from pipeserve.launch.serve import main
main()
"""


def test_a_failed_launch_stops_while_startup_listeners_still_run(
        tmp_path: Path, model_cache: Path, adapter_dir: Path) -> None:
    """The launch error is reported and the process exits even when the engine fails before
    Sanic's startup listeners finish (a stop then used to end their run and the server ran on
    forever, or died of "Event loop stopped before Future completed")."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_STARTUP, f"server.port={port}", "model=tiny",
             f"model.cache_dir={model_cache}", f"hydra.run.dir={tmp_path / 'run'}",
             f"server.files_dir={tmp_path / 'files'}", f"model.adapter_dir={adapter_dir}",
             "model.adapter=nope", "draft.gate=false"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = log.read_text(errors="replace")
    assert code == LAUNCH_ERROR, text
    assert "model.adapter 'nope' is not in model.adapter_dir" in text
    assert "Event loop stopped" not in text


# -- several adapters, chosen per request (model.adapters) ---------------------------------
@pytest.fixture(scope="module")
def multi_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("multi")
    base = ensure_model(cache_dir=model_cache)
    write_adapter(root, "lora", base, rank=4, seed=5)
    write_adapter(root, "terse", base, rank=8, num_layers=1, seed=6,
                  keys=["self_attn.q_proj", "mlp.down_proj"])
    return root


@pytest.fixture(scope="module")
def multi(server_factory: Any, multi_dir: Path, request: pytest.FixtureRequest) -> Any:
    """Two adapters mounted at launch; the engine core on a thread ("thread", the default) or
    in its own process ("process": server.isolate=true mounts them in the core process and
    publishes the set to the server's), as a test parametrizes it."""
    isolate = ["server.isolate=true"] if getattr(request, "param", "thread") == "process" else []
    return server_factory(f"model.adapter_dir={multi_dir}", "model.adapters=[lora,terse]",
                          "scheduler=continuous", "scheduler.max_batch=8", *isolate)


BOTH_CORES = pytest.mark.parametrize("multi", ["thread", "process"], indirect=True)
THREAD_CORE = pytest.mark.parametrize("multi", ["thread"], indirect=True)   # one server


def _openai(s: Any) -> Any:
    import openai
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT)


def _text(client: Any, model: str = "tiny", **extra: Any) -> str:
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                     temperature=0, logit_bias=NO_EOS, extra_body=extra or None)
    return done.choices[0].text


@BOTH_CORES
def test_models_lists_base_and_every_adapter(multi: Any) -> None:
    assert [m.id for m in _openai(multi).models.list()] == ["tiny", "tiny:lora", "tiny:terse"]
    listed = httpx.get(multi.base_url + "/v1/adapters", timeout=TIMEOUT).json()["data"]
    assert [(a["id"], a["rank"], a["default"]) for a in listed] == [("lora", 4, False),
                                                                    ("terse", 8, False)]


@BOTH_CORES
def test_model_suffix_and_adapter_field_select_the_same(multi: Any) -> None:
    client = _openai(multi)
    by_model = _text(client, "tiny:lora")
    assert by_model == _text(client, adapter="lora")
    base = _text(client)
    assert base == _text(client, adapter="none") != by_model
    assert _text(client, "tiny:terse") not in (by_model, base)
    chat = client.chat.completions.with_raw_response.create(
        model="tiny:terse", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0)
    assert "adapter=terse@" in chat.headers["x-pipeserve-record"]
    assert chat.parse().usage.model_extra["pipeserve"]["adapter"].startswith("terse@")


@BOTH_CORES
def test_unknown_adapter_is_a_404_in_each_protocols_shape(multi: Any) -> None:
    import anthropic
    import openai

    client = _openai(multi)
    with pytest.raises(openai.NotFoundError) as info:
        _text(client, "tiny:nope")
    err = info.value.body
    assert err["param"] == "model" and err["code"] == "adapter_not_found"
    assert "'nope'" in err["message"] and "mounted: lora, terse" in err["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"adapter": "nope"})
    assert info.value.body["param"] == "adapter"
    claude = anthropic.Anthropic(base_url=multi.base_url, api_key="none", max_retries=0,
                                 timeout=TIMEOUT)
    with pytest.raises(anthropic.NotFoundError) as ainfo:
        claude.messages.create(model="tiny", max_tokens=4, extra_body={"adapter": "nope"},
                               messages=[{"role": "user", "content": "hi"}])
    assert ainfo.value.body["type"] == "error"
    assert "'nope'" in ainfo.value.body["error"]["message"]
    ok = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=4, extra_body={"adapter": "lora"},
        messages=[{"role": "user", "content": "hi"}])
    assert "adapter=lora@" in ok.headers["x-pipeserve-record"]
    resp = httpx.post(multi.base_url + "/v1/responses", timeout=TIMEOUT,
                      json={"model": "tiny:terse", "input": "hi", "max_output_tokens": 4})
    assert resp.status_code == 200 and "adapter=terse@" in resp.headers["x-pipeserve-record"]
    bad = httpx.post(multi.base_url + "/v1/responses", timeout=TIMEOUT,
                     json={"model": "tiny", "adapter": "nope", "input": "hi"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "adapter"
    assert _text(client) == _text(client, adapter="none")   # still serving


@THREAD_CORE
def test_cached_tokens_never_cross_adapters(multi: Any) -> None:
    client = _openai(multi)
    prompt = "The lighthouse keeper counted ships " * 12

    def cached(**extra: Any) -> int:
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                         temperature=0, extra_body=extra)
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached(adapter="lora") == 0
    assert cached(adapter="terse") == 0
    assert cached(adapter="none") == 0
    assert cached(adapter="lora") > 0


@BOTH_CORES
def test_stacked_adapters_over_http(multi: Any) -> None:
    """`adapter: [ids]` stacks adapters on every endpoint: the record names the stack, the
    output is neither adapter's alone, a bad stack is a 400/404 naming the field, and the
    adapter metrics count the stack as its own series."""
    import anthropic
    import openai

    client = _openai(multi)
    stacked = _text(client, adapter=["lora", "terse"])
    assert stacked not in (_text(client, adapter="lora"), _text(client, adapter="terse"),
                           _text(client))
    assert stacked == _text(client, adapter=["lora", "terse"])   # deterministic, greedy
    assert _text(client, adapter=["lora"]) == _text(client, adapter="lora")
    claude = anthropic.Anthropic(base_url=multi.base_url, api_key="none", max_retries=0,
                                 timeout=TIMEOUT)
    ok = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=4, extra_body={"adapter": ["terse", "lora"]},
        messages=[{"role": "user", "content": "hi"}])
    record = ok.headers["x-pipeserve-record"]
    assert "adapter=terse@" in record and "+lora@" in record
    for bad, status in [(["lora", "lora"], openai.BadRequestError), ([], openai.BadRequestError),
                        (["lora", "nope"], openai.NotFoundError)]:
        with pytest.raises(status) as info:
            _text(client, adapter=bad)
        assert info.value.body["param"] == "adapter", bad
    fams = metric_families(multi.base_url)   # (a core process's server adds a model label)

    def requests(adapter: str) -> float:
        return sample_value(fams, "pipeserve_adapter_requests",
                            "pipeserve_adapter_requests_total", adapter=adapter)

    assert requests("lora+terse") >= 2 and requests("terse+lora") >= 1
    assert requests("none") >= 1
    assert sample_value(fams, "pipeserve_adapter_generation_tokens",
                        "pipeserve_adapter_generation_tokens_total", adapter="lora") > 0


@THREAD_CORE
def test_structured_output_holds_under_adapters(multi: Any, model_cache: Path) -> None:
    """A json_schema request validates whichever adapter (or stack) its row runs, several at
    once in one batch; the adapters still change what is written inside the schema."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    from mlx_lm.utils import load_tokenizer

    from tests.serve.test_structured import PERSON, PERSON_FORMAT

    tok = load_tokenizer(ensure_model(cache_dir=model_cache))
    closers = {str(i): 5.0 for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"}')}
    client = _openai(multi)

    def person(adapter: Any) -> dict[str, Any]:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a person"}], temperature=0,
            response_format=PERSON_FORMAT, max_tokens=300, logit_bias=closers,
            extra_body={"adapter": adapter})
        assert r.choices[0].finish_reason == "stop"
        return json.loads(r.choices[0].message.content)

    choices = ["lora", "terse", ["lora", "terse"], "none"]
    with ThreadPoolExecutor(len(choices)) as pool:
        people = list(pool.map(person, choices))
    for p in people:
        jsonschema.validate(p, PERSON)
    assert len({json.dumps(p, sort_keys=True) for p in people}) > 1
