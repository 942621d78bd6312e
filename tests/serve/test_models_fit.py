"""End to end: GET /v1/models/{id}/fit on a real server — a one-model server answers with its
loaded engine's memory model; a pool.model_dir member that is not loaded (a model directory, a
GGUF file) is sized from its files, with the same figures `pipeserve fit` gives for that path
and, once loaded, the ones its engine process publishes. Unknown ids are a 404, encoders a 400,
in OpenAI's error shape. Every request has a timeout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as T

from pipeserve.model.fit import estimate
from pipeserve.model.tiny.embed import ensure_embed_model
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import make_config
from tests.model.test_gguf import (gguf_tensors, hf_weights, llama_metadata, save_ggml_gguf,
                                   tokenizer_metadata)

TIMEOUT = 120.0
ADMIN = "adm"
FACTS = ("model_type", "served_as", "weight_bytes", "kv_bytes_per_token", "window_tokens",
         "windowed_bytes_per_token", "state_bytes_per_row", "prefill_temp_bytes",
         "device_bytes", "budget", "max_context", "max_safe_context", "rows", "fits")


def fit(srv: Any, model: str) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/v1/models/{model}/fit", timeout=TIMEOUT)


def facts(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in FACTS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("fit_dir")
    (root / "dirmodel").symlink_to(ensure_model("llama", "tiny", "float32", model_cache))
    (root / "embed").symlink_to(ensure_embed_model(model_cache))
    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    kinds = {n: (w, T.F32 if w.ndim == 1 else T.Q8_0)
             for n, w in gguf_tensors(hf_weights(vocab, tied=True)).items()}
    save_ggml_gguf(root / "q8.gguf", kinds, {**llama_metadata(vocab), **tok})
    return root


def test_a_one_model_server_answers_with_its_loaded_memory_model(server_factory: Any,
                                                                 model_cache: Path) -> None:
    srv = server_factory("admission=budget", "admission.memory_budget_gb=1")
    r = fit(srv, "tiny")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "model.fit" and body["id"] == "tiny" and body["loaded"] is True
    assert body["source"] == "the loaded model" and body["budget"] == "admission.memory_budget_gb"
    expected = estimate(make_config(f"model.cache_dir={model_cache}", "admission=budget",
                                    "admission.memory_budget_gb=1"))
    assert facts(body) == facts(expected.body())   # the launch's own estimate, field for field
    assert body["device_bytes"] == 10**9 and body["rows"][0] == {
        "tokens": 2048, "rows": expected.rows_at(2048)}
    missing = fit(srv, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "tiny" in missing.json()["error"]["message"]


def test_pool_members_are_sized_before_loading_and_agree_once_loaded(
        server_factory: Any, model_dir: Path, model_cache: Path) -> None:
    srv = server_factory("pool=dir", f"pool.model_dir={model_dir}", f"server.admin_key={ADMIN}")
    for model_id, source in (("dirmodel", "config.json and the safetensors headers"),
                             ("q8", "its GGUF header")):
        r = fit(srv, model_id)
        assert r.status_code == 200, r.text
        before = r.json()
        assert before["loaded"] is False and before["source"] == source
        path = model_dir / (model_id + ".gguf" if model_id == "q8" else model_id)
        expected = estimate(make_config(f"model.path={path}",
                                        f"model.cache_dir={model_cache / 'fit-gguf'}"))
        assert facts(before) == facts(expected.body())   # what `pipeserve fit` prints for it
    assert not (model_cache / "fit-gguf").exists() or not any(
        (model_cache / "fit-gguf").iterdir()), "sizing the GGUF converted it"
    admin = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=ADMIN, max_retries=0,
                          timeout=TIMEOUT)
    before = fit(srv, "dirmodel").json()
    assert admin.post("/models/dirmodel/load", cast_to=object, body={})["loaded"] is True
    after = fit(srv, "dirmodel").json()
    assert after["loaded"] is True and after["source"] == "the loaded model"
    assert facts(after) == facts(before)
    r = fit(srv, "embed")
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
