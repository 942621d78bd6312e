"""End to end: POST /v1/embeddings on `model=tiny_embed` (a generated random-weight BERT that
mlx-embeddings loads), served alone. The server's vectors equal mlx-embeddings' own on the same
inputs (float32: within 1e-5 per component), batched equals one by one, base64 decodes to the
same floats, and the openai SDK's embeddings.create works. As a pool member beside chat models,
and /v1/rerank on a cross-encoder: tests/serve/test_models_api.py (its pool's model_dir)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pipeserve.model.tiny.embed import ensure_embed_model

TIMEOUT = 60.0
TOL = 1e-5
TEXTS = ["The morning train left the station at seven.", "café 🙂",
         "Where are my keys? On the table, next to the old notebook and the coffee."]


@pytest.fixture(scope="module")
def alone(server_factory: Any) -> Any:
    return server_factory("model=tiny_embed")


@pytest.fixture(scope="module")
def reference(model_cache: Path) -> Any:
    """mlx-embeddings on the same model, one input at a time: (tokenizer, vector of ids)."""
    import mlx.core as mx
    from mlx_embeddings import load

    model, tokenizer = load(str(ensure_embed_model(model_cache)))

    def vector(ids: list[int]) -> np.ndarray:
        out = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))
        return np.array(out.text_embeds[0].astype(mx.float32))
    return tokenizer, vector


def post(srv: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/embeddings", json=body, timeout=TIMEOUT)


def test_vectors_equal_mlx_embeddings_batched_and_one_by_one(alone: Any, reference: Any) -> None:
    tokenizer, vector = reference
    r = post(alone, {"model": "tiny_embed", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny_embed"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                             "total_tokens": sum(map(len, ids))}
    for d, want_ids in zip(body["data"], ids):
        got = np.array(d["embedding"], dtype=np.float32)
        assert d["object"] == "embedding" and got.shape == (64,)
        np.testing.assert_allclose(got, vector(want_ids), atol=TOL)
        assert abs(np.linalg.norm(got) - 1) < 1e-5   # the library L2-normalises
    for text, d in zip(TEXTS, body["data"]):   # one by one: the same vectors as in the batch
        one = post(alone, {"model": "tiny_embed", "input": text}).json()["data"][0]
        np.testing.assert_allclose(one["embedding"], d["embedding"], atol=TOL)
    by_ids = post(alone, {"model": "tiny_embed", "input": ids}).json()["data"]   # token arrays
    for a, b in zip(by_ids, body["data"]):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=TOL)


def test_base64_dimensions_and_the_openai_sdk(alone: Any) -> None:
    floats = post(alone, {"input": TEXTS[0]}).json()["data"][0]["embedding"]
    b64 = post(alone, {"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]
    decoded = np.frombuffer(base64.b64decode(b64["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats, dtype=np.float32))
    short = np.array(post(alone, {"input": TEXTS[0], "dimensions": 16}).json()["data"][0]
                     ["embedding"])
    want = np.array(floats[:16]) / np.linalg.norm(floats[:16])
    np.testing.assert_allclose(short, want, atol=1e-6)
    client = openai.OpenAI(base_url=alone.base_url + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model="tiny_embed", input=TEXTS)   # the SDK asks for base64
    assert len(r.data) == 3 and r.usage.prompt_tokens > 0
    np.testing.assert_allclose(r.data[0].embedding, floats, atol=1e-7)
    assert len(client.embeddings.create(model="tiny_embed", input="x", dimensions=8)
               .data[0].embedding) == 8


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", ["non-empty"]),
    ({"input": []}, "input", ["input"]),
    ({"input": ["ok", 3]}, "input", ["input[1]"]),
    ({"input": [[1, 2], [99999]]}, "input", ["input[1]", "99999", "[0, 512)"]),
    ({"input": "x" * 3000}, "input", ["tokens", "512"]),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", ["float, base64"]),
    ({"input": "x", "dimensions": 65}, "dimensions", ["64"]),
])
def test_bad_embedding_requests_are_400_naming_the_field(alone: Any, body: dict[str, Any],
                                                         param: str, words: list[str]) -> None:
    r = post(alone, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"]


def test_generation_endpoints_on_an_embedding_model_say_so(alone: Any) -> None:
    r = httpx.post(alone.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    model = httpx.get(alone.base_url + "/v1/models/tiny_embed", timeout=TIMEOUT).json()
    assert model["task"] == "embed" and model["loaded"] is True
    assert httpx.get(alone.base_url + "/health", timeout=TIMEOUT).status_code == 200
