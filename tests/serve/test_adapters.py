"""End to end: `serve.py model.adapter_dir=... model.adapter=<id>` as a real process —
GET /v1/adapters lists what is mounted (behind server.api_key like every /v1 route), the
reproducibility record names the adapter, and a bad adapter stops the launch with its reason."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.tiny import ensure_model
from tests.pipeline.test_adapters import write_adapter
from tests.serve.test_openai import NO_EOS, TIMEOUT

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
