"""Hot-swap over HTTP, through a real `serve.py` and the openai SDK:
POST /v1/adapters mounts a subdirectory of model.adapter_dir at runtime — its greedy output
equals a server launched with that adapter — and DELETE /v1/adapters/{id} unmounts it (404
for it afterwards); a mount while another request streams leaves that stream's tokens as
they are alone; DELETE of an adapter a request uses is a 409 and that request goes on; the
admin key guards both; bad ids are 400/404 in OpenAI's error shape; the server keeps serving.
The same tests run with the engine core in its own process (server.isolate=true): the swap and
the adapter set cross the pipe, the output equals the thread core's launched reference, and a
core process that dies comes back with the adapters it had."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.adapters.test_adapters import write_adapter
from tests.serve.test_engine_process import wait_health
from tests.serve.test_openai import NO_EOS, TIMEOUT
from tests.serve.test_pool import engine_pid

ADMIN = "swap-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("hotswap")
    base = ensure_model(cache_dir=model_cache)
    write_adapter(root, "lora", base, rank=4, seed=5)
    write_adapter(root, "terse", base, rank=8, num_layers=1, seed=6,
                  keys=["self_attn.q_proj", "mlp.down_proj"])
    write_adapter(root, "dora", base, rank=4, dora=True, seed=7)
    wrong = write_adapter(root, "wrong", base, rank=4, seed=8)
    weights = dict(mx.load(str(wrong / "adapters.safetensors")))
    name = min(k for k in weights if k.endswith("lora_a"))
    weights[name] = mx.zeros((weights[name].shape[0] + 3, 4))   # a base layer it does not fit
    mx.save_safetensors(str(wrong / "adapters.safetensors"), weights)
    (root / "empty").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(outside, "elsewhere", base, rank=4, seed=9)
    os.symlink(outside / "elsewhere", root / "escape")
    return root


@pytest.fixture(scope="module")
def hot(server_factory: Any, adapter_dir: Path, request: pytest.FixtureRequest) -> Any:
    """No adapter at launch, only the directory; the admin key set. Its engine core runs on a
    thread ("thread", the default) or in its own process ("process": server.isolate=true,
    where swaps and the adapter set cross the pipe), as a test parametrizes it."""
    core = getattr(request, "param", "thread")
    return server_factory(f"model.adapter_dir={adapter_dir}", f"server.admin_key={ADMIN}",
                          "scheduler=continuous", "scheduler.max_batch=8",
                          *(["server.isolate=true"] if core == "process" else []))


BOTH_CORES = pytest.mark.parametrize("hot", ["thread", "process"], indirect=True)
THREAD_CORE = pytest.mark.parametrize("hot", ["thread"], indirect=True)   # one server


@pytest.fixture(scope="module")
def launched(server_factory: Any, adapter_dir: Path) -> Any:
    """The reference: lora (the default) and terse mounted at launch; no admin key."""
    return server_factory(f"model.adapter_dir={adapter_dir}", "model.adapter=lora",
                          "model.adapters=[terse]", "scheduler=continuous",
                          "scheduler.max_batch=8")


def _client(s: Any) -> Any:
    import openai
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT)


def _text(s: Any, model: str = "tiny", max_tokens: int = 12, **extra: Any) -> str:
    done = _client(s).completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                         temperature=0, logit_bias=NO_EOS,
                                         extra_body=extra or None)
    return done.choices[0].text


def _mount(s: Any, adapter_id: Any, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.post(s.base_url + "/v1/adapters", json={"id": adapter_id}, headers=headers,
                      timeout=TIMEOUT)


def _unmount(s: Any, adapter_id: str, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.delete(s.base_url + f"/v1/adapters/{adapter_id}", headers=headers,
                        timeout=TIMEOUT)


def _listed(s: Any) -> tuple[list[str], list[str]]:
    models = [m.id for m in _client(s).models.list()]
    adapters = [a["id"] for a in httpx.get(s.base_url + "/v1/adapters",
                                           timeout=TIMEOUT).json()["data"]]
    return models, adapters


def _still_serving(s: Any) -> None:
    assert _text(s, max_tokens=2)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    return err


@BOTH_CORES
def test_mount_equals_launch_and_unmount_404s(hot: Any, launched: Any) -> None:
    assert _listed(hot) == (["tiny"], [])
    want_terse = _text(launched, "tiny:terse")
    want_lora = _text(launched, adapter="lora")
    base = _text(hot)
    r = _mount(hot, "terse")
    assert r.status_code == 200, r.text
    entry = r.json()
    assert entry["id"] == "terse" and entry["rank"] == 8 and entry["default"] is False
    assert entry["target_modules"] == ["mlp.down_proj", "self_attn.q_proj"]
    assert _text(hot, "tiny:terse") == want_terse != base
    r = _mount(hot, "lora")   # a second one: the stacks grow to its layers and rank
    assert r.status_code == 200, r.text
    assert _listed(hot) == (["tiny", "tiny:terse", "tiny:lora"], ["terse", "lora"])
    assert _text(hot, adapter="lora") == want_lora
    assert _text(hot, "tiny:terse") == want_terse
    assert _text(hot) == base
    r = _unmount(hot, "terse")
    assert r.status_code == 200 and r.json()["deleted"] is True and r.json()["id"] == "terse"
    assert _listed(hot) == (["tiny", "tiny:lora"], ["lora"])
    import openai
    with pytest.raises(openai.NotFoundError) as info:
        _text(hot, "tiny:terse")
    body = info.value.body
    assert body["code"] == "adapter_not_found" and "'terse'" in body["message"]
    assert _text(hot, adapter="lora") == want_lora and _text(hot) == base
    assert _mount(hot, "terse").status_code == 200   # back again, same output
    assert _text(hot, "tiny:terse") == want_terse
    assert _unmount(hot, "terse").status_code == 200
    assert _unmount(hot, "lora").status_code == 200
    assert _listed(hot) == (["tiny"], []) and _text(hot) == base


def _stream(s: Any, first: threading.Event, out: dict[str, Any], max_tokens: int,
            **extra: Any) -> None:
    chunks = []
    stream = _client(s).completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                           temperature=0, logit_bias=NO_EOS, stream=True,
                                           extra_body=extra or None)
    for chunk in stream:
        chunks.append(chunk)
        first.set()
    out["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
    out["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    out["done_at"] = time.monotonic()


@THREAD_CORE   # the process core swaps under streams in test_repeated_swaps_under_load_…
def test_mount_while_streaming_leaves_the_stream_alone(hot: Any, launched: Any) -> None:
    solo = _text(hot, max_tokens=1500, adapter="none")
    first, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(hot, first, out, 1500), kwargs={"adapter": "none"})
    t.start()
    assert first.wait(TIMEOUT)
    r = _mount(hot, "lora")
    mounted_at = time.monotonic()
    assert r.status_code == 200, r.text
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert mounted_at < out["done_at"]   # the mount ran while the stream was decoding
    assert out["text"] == solo and out["finish"] == "length"
    assert _text(hot, adapter="lora") == _text(launched, adapter="lora")
    assert _unmount(hot, "lora").status_code == 200


@BOTH_CORES
def test_delete_of_a_busy_adapter_is_409_and_the_stream_goes_on(hot: Any) -> None:
    assert _mount(hot, "terse").status_code == 200
    solo = _text(hot, "tiny:terse", max_tokens=1500)
    first, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(hot, first, out, 1500), kwargs={"adapter": "terse"})
    t.start()
    assert first.wait(TIMEOUT)
    err = _error(_unmount(hot, "terse"), 409)
    refused_at = time.monotonic()
    assert err["code"] == "adapter_busy" and "in use by 1 running or waiting" in err["message"]
    t.join(TIMEOUT)
    assert not t.is_alive() and refused_at < out["done_at"]
    assert out["text"] == solo and out["finish"] == "length"
    assert _unmount(hot, "terse").status_code == 200   # free now
    _still_serving(hot)


@BOTH_CORES
def test_repeated_swaps_under_load_change_no_stream(hot: Any) -> None:
    """Streams on an adapter, a stack holding it and the base model run while another adapter
    is mounted and unmounted again and again: none fails, each equals its solo output."""
    assert _mount(hot, "lora").status_code == 200
    kinds = [{"adapter": "lora"}, {"adapter": ["lora"]}, {"adapter": "none"}]
    solo = [_text(hot, max_tokens=600, **k) for k in kinds]
    firsts = [threading.Event() for _ in kinds]
    outs: list[dict[str, Any]] = [{} for _ in kinds]
    threads = [threading.Thread(target=_stream, args=(hot, f, o, 600), kwargs=k)
               for f, o, k in zip(firsts, outs, kinds)]
    for t in threads:
        t.start()
    assert all(f.wait(TIMEOUT) for f in firsts)
    swaps = 0
    while any(t.is_alive() for t in threads) and swaps < 6:   # bounded: 6 mount/unmounts
        assert _mount(hot, "terse").status_code == 200
        assert _unmount(hot, "terse").status_code == 200
        swaps += 1
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert swaps >= 1
    assert [o["text"] for o in outs] == solo and all(o["finish"] == "length" for o in outs)
    assert _unmount(hot, "lora").status_code == 200
    _still_serving(hot)


@THREAD_CORE
def test_admin_key_is_enforced(hot: Any) -> None:
    assert _error(_mount(hot, "lora", headers=None), 401)["type"] == "authentication_error"
    assert _mount(hot, "lora", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert _error(_unmount(hot, "lora", headers=None), 401)
    assert _listed(hot)[1] == []
    _still_serving(hot)


@BOTH_CORES
def test_bad_ids_are_400_404_409_in_openais_shape(hot: Any, launched: Any) -> None:
    err = _error(_mount(hot, "nope"), 404)
    assert err["param"] == "id" and "'nope'" in err["message"] and "lora" in err["message"]
    _still_serving(hot)
    for bad in ("../lora", "a/b", ".."):
        err = _error(_mount(hot, bad), 400)
        assert err["param"] == "id" and "not an adapter id" in err["message"]
    err = _error(_mount(hot, "escape"), 400)
    assert "outside" in err["message"]
    _still_serving(hot)
    err = _error(_mount(hot, "wrong"), 400)
    assert "layer" in err["message"] and "lora_a" in err["message"] and "shape" in err["message"]
    _still_serving(hot)
    err = _error(_mount(hot, "dora"), 400)
    assert err["code"] == "adapter_dora"
    err = _error(_mount(hot, "empty"), 400)
    assert "adapters.safetensors" in err["message"]
    _error(_mount(hot, 7), 400)
    assert httpx.post(hot.base_url + "/v1/adapters", content=b"{", headers=AUTH,
                      timeout=TIMEOUT).status_code == 400
    assert _listed(hot) == (["tiny"], [])
    base = _text(hot)
    assert _mount(hot, "lora").status_code == 200   # nothing left half-converted
    assert _text(hot, adapter="lora") == _text(launched, adapter="lora")
    assert _text(hot) == base
    assert _error(_mount(hot, "lora"), 409)["code"] == "adapter_mounted"
    assert _unmount(hot, "lora").status_code == 200
    assert _error(_unmount(hot, "lora"), 404)["code"] == "adapter_not_found"
    assert _error(_unmount(hot, "nope"), 404)["param"] == "id"
    _still_serving(hot)


@pytest.mark.parametrize("hot", ["process"], indirect=True)
def test_a_restarted_core_process_mounts_what_it_had(hot: Any, launched: Any) -> None:
    """kill -9 of the core process: the new one mounts the adapters mounted over HTTP before
    (and not those unmounted), so the list and the output are as before the crash."""
    assert _mount(hot, "terse").status_code == 200
    assert _mount(hot, "lora").status_code == 200
    assert _unmount(hot, "lora").status_code == 200
    victim = engine_pid(hot, "tiny")
    os.kill(victim, signal.SIGKILL)
    for _ in range(1200):   # the server sees the exit and starts a new core (bounded)
        if "exited (killed by signal 9)" in hot.log():
            break
        time.sleep(0.05)
    wait_health(hot.base_url, 200)
    assert engine_pid(hot, "tiny") != victim
    assert _listed(hot) == (["tiny", "tiny:terse"], ["terse"])
    assert _text(hot, "tiny:terse") == _text(launched, "tiny:terse")
    assert _unmount(hot, "terse").status_code == 200
    assert _listed(hot) == (["tiny"], [])


def test_launch_default_cannot_be_unmounted(launched: Any) -> None:
    err = _error(_unmount(launched, "lora"), 409)   # no admin key set: no key needed
    assert err["code"] == "adapter_default"
    assert _listed(launched) == (["tiny", "tiny:lora", "tiny:terse"], ["lora", "terse"])
    err = _error(_mount(launched, "dora", headers=None), 400)
    assert err["code"] == "adapter_dora"
    _still_serving(launched)


def test_with_an_api_key_too_the_admin_key_guards_swaps(server_factory: Any,
                                                        adapter_dir: Path) -> None:
    s = server_factory(f"model.adapter_dir={adapter_dir}", f"server.admin_key={ADMIN}",
                       "server.api_key=user-key")
    user = {"Authorization": "Bearer user-key"}
    assert _mount(s, "lora", headers=user).status_code == 401
    assert _mount(s, "lora").status_code == 200
    listed = httpx.get(s.base_url + "/v1/adapters", headers=user, timeout=TIMEOUT)
    assert [a["id"] for a in listed.json()["data"]] == ["lora"]
    # the admin key opens the API routes too (it may ask for the urgent priority classes)
    assert httpx.get(s.base_url + "/v1/adapters", headers=AUTH, timeout=TIMEOUT).status_code == 200
    assert httpx.get(s.base_url + "/v1/adapters", headers={"Authorization": "Bearer nope"},
                     timeout=TIMEOUT).status_code == 401
    assert _unmount(s, "lora", headers=user).status_code == 401
    assert _unmount(s, "lora").status_code == 200
