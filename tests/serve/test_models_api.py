"""End to end: the models API on a real pool (`pool=example` with max_resident=1, plus the
models of a pool.model_dir: a chat model, an embedding model and a cross-encoder) — requests for
two models while one loads all succeed (they wait, none is a 429, no load is counted failed);
GET /v1/models/{id}; load (with SSE progress) and unload with the admin key; per-request
keep_alive over pool.idle_unload_s; rescan of the directory; embeddings and rerank from pool
members equal mlx-embeddings' own. Every request has a timeout; every wait loop is bounded."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pipeserve.model.tiny.text import ensure_model
from pipeserve.model.tiny.embed import ensure_embed_model
from tests.serve.test_openai import NO_EOS, metric_families, sample_value

QWEN, LLAMA, DIR_MODEL, EMBED, RERANK = "tiny-qwen3", "tiny-llama", "dirmodel", "embed", "rerank"
TIMEOUT = 60.0
ADMIN = "adm"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("model_dir")
    (root / DIR_MODEL).symlink_to(ensure_model("llama", "tiny", "float32", model_cache))
    (root / EMBED).symlink_to(ensure_embed_model(model_cache))   # found as model.task=embed
    (root / RERANK).symlink_to(ensure_embed_model(model_cache, "rerank"))   # task=rerank
    (root / "notes").mkdir()   # not a model: no config.json
    return root


@pytest.fixture(scope="module")
def srv(server_factory: Any, model_dir: Path) -> Any:
    return server_factory("pool=example", "pool.max_resident=1", "pool.idle_unload_s=30",
                          f"server.admin_key={ADMIN}", f"pool.model_dir={model_dir}")


def client(srv: Any, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=TIMEOUT)


def chat(srv: Any, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": model, "messages": [{"role": "user", "content": "Where are my keys?"}],
        "max_tokens": 6, "temperature": 0, "logit_bias": NO_EOS, **extra})


def entry(srv: Any, model: str) -> dict[str, Any]:
    r = httpx.get(f"{srv.base_url}/v1/models/{model}", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def wait_state(srv: Any, model: str, state: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if entry(srv, model)["state"] == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"{model} not {state} in {timeout_s} s: {entry(srv, model)}")


def loads(srv: Any, model: str, outcome: str) -> float:
    return sample_value(metric_families(srv.base_url), "pipeserve_model_load",
                        "pipeserve_model_load_total", model=model, outcome=outcome)


def test_requests_for_two_models_while_one_loads_all_succeed(srv: Any) -> None:
    """max_resident=1: llama's requests wait for qwen3 (loading at launch, then serving) to go
    idle, evict it and load; qwen3's requests sent meanwhile wait for llama in turn."""
    wait_state(srv, QWEN, "loaded")
    statuses: dict[str, list[int]] = {QWEN: [], LLAMA: []}
    lock = threading.Lock()

    def send(model: str) -> None:
        r = chat(srv, model)
        with lock:
            statuses[model].append(r.status_code)
    t0 = time.monotonic()
    threads = [threading.Thread(target=send, args=(LLAMA,)) for _ in range(3)]
    for t in threads:
        t.start()
    wait_state(srv, LLAMA, "loading")
    threads += [threading.Thread(target=send, args=(QWEN,)) for _ in range(2)]
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join(120)
    elapsed = time.monotonic() - t0
    assert statuses == {QWEN: [200, 200], LLAMA: [200, 200, 200]}, statuses
    for model in (QWEN, LLAMA):
        assert loads(srv, model, "failed") == 0 and loads(srv, model, "busy") == 0
    print(f"\npool-load concurrency: 5 requests (3 {LLAMA}, 2 {QWEN}) with max_resident=1 "
          f"while {LLAMA} loaded: all 200 in {elapsed:.2f} s; loads ok: "
          f"{QWEN} {loads(srv, QWEN, 'ok'):.0f}, {LLAMA} {loads(srv, LLAMA, 'ok'):.0f}; "
          "failed 0, busy 0")


def test_get_model_for_loaded_unloaded_and_unknown_ids(srv: Any) -> None:
    assert chat(srv, LLAMA).status_code == 200   # llama loaded, so qwen3 is not (max 1)
    loaded, unloaded = entry(srv, LLAMA), entry(srv, QWEN)
    assert loaded["object"] == "model" and loaded["id"] == LLAMA
    assert loaded["loaded"] is True and loaded["state"] == "loaded"
    assert loaded["context_length"] == 4096 and loaded["modalities"] == ["text"]
    assert loaded["tool_format"] == "hermes" and loaded["resident_bytes"] > 100_000
    assert unloaded["loaded"] is False and unloaded["state"] == "unloaded"
    assert unloaded["resident_bytes"] == 0 and unloaded["context_length"] == 4096  # known
    assert entry(srv, DIR_MODEL)["context_length"] is None   # never loaded: not known yet
    r = httpx.get(srv.base_url + "/v1/models/nope", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert QWEN in r.json()["error"]["message"]
    sdk = client(srv).models
    assert sdk.retrieve(LLAMA).id == LLAMA
    listed = {m.id: m for m in sdk.list().data}
    assert set(listed) == {QWEN, LLAMA, DIR_MODEL, EMBED, RERANK}
    assert listed[EMBED].model_extra["task"] == "embed"
    assert listed[RERANK].model_extra["task"] == "rerank"
    assert listed[LLAMA].model_extra["loaded"] is True


def test_load_and_unload_need_the_admin_key_and_stream_progress(srv: Any) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(srv).post(f"/models/{LLAMA}/unload", cast_to=object, body={})
    admin = client(srv, ADMIN)
    gone = admin.post(f"/models/{LLAMA}/unload", cast_to=object, body={})
    assert gone["state"] == "unloaded" and gone["loaded"] is False
    events = []
    with httpx.stream("POST", f"{srv.base_url}/v1/models/{QWEN}/load", json={"stream": True},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    progress = [json.loads(e) for e in events[:-1]]
    assert progress[0]["status"] == "loading" and progress[-1]["status"] == "loaded"
    assert progress[-1]["model"]["id"] == QWEN and progress[-1]["model"]["loaded"] is True
    assert all(p["object"] == "model.load" for p in progress)
    again = admin.post(f"/models/{QWEN}/load", cast_to=object, body={})   # already loaded
    assert again["state"] == "loaded"
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=LLAMA, reason="request") == 1
    with pytest.raises(openai.NotFoundError):
        admin.post("/models/nope/load", cast_to=object, body={})


def test_keep_alive_overrides_idle_unload(srv: Any) -> None:
    r = chat(srv, QWEN, keep_alive=0)   # unload as soon as it is done
    assert r.status_code == 200
    wait_state(srv, QWEN, "unloaded")
    fams = metric_families(srv.base_url)
    assert sample_value(fams, "pipeserve_model_unload", "pipeserve_model_unload_total",
                        model=QWEN, reason="keep_alive") == 1
    assert chat(srv, QWEN, keep_alive="-1").status_code == 200
    assert entry(srv, QWEN)["keep_alive_s"] == -1
    time.sleep(1.0)   # past a keep_alive of 0 or a short one: still loaded
    assert entry(srv, QWEN)["state"] == "loaded"
    r = chat(srv, QWEN, keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_model_dir_members_serve_and_rescan_finds_new_ones(srv: Any, model_dir: Path,
                                                           model_cache: Path) -> None:
    assert chat(srv, DIR_MODEL).status_code == 200
    assert entry(srv, DIR_MODEL)["loaded"] is True
    (model_dir / "second").symlink_to(ensure_model("qwen3", "tiny", "float32", model_cache))
    (model_dir / DIR_MODEL).unlink()   # loaded: it stays until it unloads
    r = httpx.post(srv.base_url + "/v1/models/rescan", timeout=TIMEOUT)
    assert r.status_code == 401
    r = httpx.post(srv.base_url + "/v1/models/rescan", timeout=TIMEOUT,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    assert r.json()["added"] == ["second"] and r.json()["removed"] == []
    assert {m["id"] for m in r.json()["data"]} == {QWEN, LLAMA, DIR_MODEL, EMBED, RERANK,
                                                   "second"}
    assert entry(srv, "second")["state"] == "unloaded"
    client(srv, ADMIN).post(f"/models/{DIR_MODEL}/unload", cast_to=object, body={})
    r = httpx.post(srv.base_url + "/v1/models/rescan", timeout=TIMEOUT,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.json()["removed"] == [DIR_MODEL]
    assert httpx.get(f"{srv.base_url}/v1/models/{DIR_MODEL}", timeout=TIMEOUT).status_code == 404


def test_prompt_scoring_and_tokenize_reach_the_routed_member(srv: Any, model_cache: Path) -> None:
    """Echo with logprobs runs in the member's engine process (its pipe's `score` op) and
    equals mlx-lm on the same weights; /tokenize uses the member's tokenizer."""
    import mlx.core as mx
    from mlx_lm import load

    text = "The quiet library, students whispered."
    ids = httpx.post(srv.base_url + "/tokenize", json={"model": LLAMA, "prompt": text},
                     timeout=TIMEOUT).json()["tokens"]
    r = httpx.post(srv.base_url + "/v1/completions", timeout=TIMEOUT, json={
        "model": LLAMA, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    model, tokenizer = load(str(ensure_model("llama", "tiny", "float32", model_cache)))
    assert ids == tokenizer.encode(text)
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert got[0] is None
    assert got[1:] == pytest.approx([lps[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
                                    abs=1e-4)


def test_an_embedding_model_and_a_reranker_serve_beside_chat_models(srv: Any,
                                                                    model_cache: Path) -> None:
    """Found in pool.model_dir as encoders: /v1/embeddings and /v1/rerank from their own
    engine processes equal mlx-embeddings on the same weights (float32, 1e-5)."""
    import mlx.core as mx
    from mlx_embeddings import load

    texts = ["The morning train left the station at seven.", "café 🙂"]
    r = httpx.post(srv.base_url + "/v1/embeddings", timeout=TIMEOUT,
                   json={"model": EMBED, "input": texts})
    assert r.status_code == 200, r.text
    model, tokenizer = load(str(ensure_embed_model(model_cache)))
    for text, d in zip(texts, r.json()["data"]):
        ids = tokenizer.encode(text)
        want = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds[0]
        assert d["embedding"] == pytest.approx(want.tolist(), abs=1e-5)
    wrong = httpx.post(srv.base_url + "/v1/embeddings", timeout=TIMEOUT,
                       json={"model": QWEN, "input": "x"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "not_an_embedding_model"
    chat_on_embed = chat(srv, EMBED)
    assert chat_on_embed.status_code == 400 and "/v1/embeddings" in chat_on_embed.text

    query = "Where are my keys?"
    docs = ["On the table.", {"text": "The morning train left at seven."}, "In the river."]
    r = httpx.post(srv.base_url + "/v1/rerank", timeout=TIMEOUT,
                   json={"model": RERANK, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    model, tokenizer = load(str(ensure_embed_model(model_cache, "rerank")))
    texts = [d if isinstance(d, str) else d["text"] for d in docs]
    want = []
    for text in texts:   # the tokenizer's pair encoding, the model's classifier head
        ids = tokenizer._tokenizer(query, text)["input_ids"]
        out = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))
        want.append(out.pooler_output[0, 0].item())
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -want[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"]["text"] == texts[x["index"]]
    assert body["usage"]["total_tokens"] > 0 and body["model"] == RERANK
    top = httpx.post(srv.base_url + "/rerank", timeout=TIMEOUT, json={
        "model": RERANK, "query": query, "documents": texts, "top_n": 1,
        "return_documents": False}).json()
    assert top["results"] == [{k: v for k, v in results[0].items() if k != "document"}]
    bad = httpx.post(srv.base_url + "/v1/rerank", timeout=TIMEOUT,
                     json={"model": RERANK, "query": query, "documents": [3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    not_reranker = httpx.post(srv.base_url + "/v1/rerank", timeout=TIMEOUT,
                              json={"model": EMBED, "query": query, "documents": texts})
    assert not_reranker.status_code == 400
    assert not_reranker.json()["error"]["code"] == "not_a_reranker"
