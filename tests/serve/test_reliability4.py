"""End to end, issue 44 (reliability, round 4), on real `serve.py` processes on 127.0.0.1: the API
key guards every route of the route table with or without a trailing slash, and only the admin
key may ask for an urgent priority; embeddings, rerank and /tokenize refuse by length before
tokenizing, the embedding engine is shared fairly, /detokenize refuses by count; a
request's images are bounded in decoded pixels, only listed formats open, a data URL's type must
match its bytes, mutated images are never 5xx, and a text chat never waits behind media; the
active-rows gauge follows aborts. Every request has a timeout; every wait is bounded."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import make_config

TIMEOUT = 30.0
KEY = "round4-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = "round4-admin"
# routes anyone may read: liveness, the chat page and its icons (metrics_auth is off here)
PUBLIC = {"/health", "/metrics", "/", "/favicon.ico", "/favicon.svg"}


@pytest.fixture(scope="module")
def keyed(server_factory: Any) -> Any:
    return server_factory(f"server.api_key={KEY}", f"server.admin_key={ADMIN}")


def _route_table() -> list[tuple[str, str]]:
    """(method, path) of every route the app declares, path parameters filled in."""
    from pipeserve.http.server import build_app

    app = build_app(make_config(f"server.api_key={KEY}"))
    out = []
    for route in app.router.routes:
        path = "/" + re.sub(r"<[^>]+>", "x", route.path)
        out += [(method, path) for method in route.methods if method not in ("HEAD", "OPTIONS")]
    return sorted(set(out))


def test_every_route_needs_the_key_with_or_without_a_trailing_slash(keyed: Any) -> None:
    table = _route_table()
    assert ("POST", "/tokenize") in table and ("POST", "/v2/rerank") in table
    guarded = 0
    for method, path in table:
        if path in PUBLIC:
            continue
        for variant in {path, path.rstrip("/") + "/"}:
            r = httpx.request(method, keyed.base_url + variant, json={}, timeout=TIMEOUT)
            assert r.status_code == 401, (method, variant, r.status_code, r.text[:200])
            assert "key" in r.json()["error"]["message"]
            guarded += 1
    assert guarded >= 40
    # with the key, the slash-suffixed tokenizer route answers as the plain one does
    body = {"prompt": "hello there"}
    plain = httpx.post(keyed.base_url + "/tokenize", json=body, headers=AUTH, timeout=TIMEOUT)
    slash = httpx.post(keyed.base_url + "/tokenize/", json=body, headers=AUTH, timeout=TIMEOUT)
    assert plain.status_code == slash.status_code == 200
    assert plain.json()["tokens"] == slash.json()["tokens"]


# -- embeddings and rerank: refused by length before tokenizing; one engine shared fairly -------
@pytest.fixture(scope="module")
def embedder(server_factory: Any) -> Any:
    return server_factory("model=tiny_embed", "server.max_body_mb=32")


@pytest.fixture(scope="module")
def reranker(server_factory: Any) -> Any:
    return server_factory("model=tiny_rerank", "server.max_body_mb=32")


def test_a_huge_embedding_input_is_refused_by_its_length(embedder: Any) -> None:
    huge = "word " * 2_000_000   # 10 MB: the old path tokenized all of it first
    r = httpx.post(embedder.base_url + "/v1/embeddings",
                   json={"input": ["fine", huge]}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and err["code"] == "context_length_exceeded"
    assert "input[1] is 10000000 characters: at least" in err["message"]
    assert "at most 512" in err["message"]
    ok = httpx.post(embedder.base_url + "/v1/embeddings", json={"input": "fine"}, timeout=TIMEOUT)
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_a_huge_rerank_document_is_refused_by_its_length(reranker: Any) -> None:
    body = {"query": "which one", "documents": ["short", "x " * 3_000_000]}
    r = httpx.post(reranker.base_url + "/v1/rerank", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "documents" and err["code"] == "context_length_exceeded"
    assert "documents[1] is 6000000 characters: at least" in err["message"]
    body["query"] = "q " * 3_000_000
    r = httpx.post(reranker.base_url + "/v2/rerank", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "query", r.text


def test_a_small_embedding_is_not_held_behind_a_huge_batch(embedder: Any) -> None:
    """128 inputs of 510 ids each take four forwards; a one-string request sent meanwhile is
    answered between two of them, long before the big one ends."""
    base = embedder.base_url
    big = {"input": [[(7 * i + j) % 500 + 5 for j in range(510)] for i in range(128)]}
    order: list[str] = []
    with ThreadPoolExecutor(2) as ex:
        slow = ex.submit(lambda: (httpx.post(base + "/v1/embeddings", json=big, timeout=600),
                                  order.append("big"))[0])
        for _ in range(600):   # bounded: until the big one is in the engine
            if httpx.get(base + "/health", timeout=TIMEOUT).json()["inflight"] >= 1:
                break
            time.sleep(0.01)
        small = httpx.post(base + "/v1/embeddings", json={"input": "one string"}, timeout=600)
        order.append("small")
        assert small.status_code == 200, small.text
        r = slow.result(timeout=600)
    assert r.status_code == 200 and len(r.json()["data"]) == 128, r.text[:300]
    assert order == ["small", "big"]


# -- the tokenizer endpoints: refused by length; ids checked off the event loop ---------------
def test_tokenize_refuses_a_huge_prompt_by_its_length(keyed: Any) -> None:
    base = keyed.base_url
    for body, field in (({"prompt": "token " * 2_000_000}, "prompt"),
                        ({"messages": [{"role": "user", "content": "token " * 2_000_000}]},
                         "messages")):
        r = httpx.post(base + "/tokenize", json=body, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "context_length_exceeded"
        assert "characters; no token of this tokenizer spells more than" in err["message"]


def test_detokenize_refuses_millions_of_ids_by_their_count(keyed: Any) -> None:
    base = keyed.base_url
    tokens = [5] * 4_000_000 + [10**9]
    with ThreadPoolExecutor(1) as ex:
        big = ex.submit(httpx.post, base + "/detokenize", json={"tokens": tokens}, headers=AUTH,
                        timeout=120)
        health = [httpx.get(base + "/health", timeout=TIMEOUT).status_code for _ in range(5)]
        r = big.result(timeout=120)
    assert health == [200] * 5
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "tokens" and err["code"] == "context_length_exceeded"
    assert "tokens has 4000001 ids; the limit is the context length, 4096" in err["message"]
    # at the limit the ids are read: the bad one is named
    r = httpx.post(base + "/detokenize", json={"tokens": [5] * 4095 + [10**9]}, headers=AUTH,
                   timeout=TIMEOUT)
    assert r.status_code == 400 and "tokens[4095] is 1000000000" in r.json()["error"]["message"]
    r = httpx.post(base + "/detokenize", json={"tokens": [5] * 4096}, headers=AUTH,
                   timeout=TIMEOUT)
    assert r.status_code == 200 and len(r.json()["prompt"]) > 0


# -- images: a request's decoded pixels are bounded; text never waits behind media ------------
def _png(size: tuple[int, int], seed: int = 0) -> str:
    """A PNG of `size` that compresses to a few kB (flat colour): cheap to send, costly to
    decode."""
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", size, (seed % 255, 90, 160)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(images: list[str], text: str = "Describe.") -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"model": "tiny_vlm", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]}


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def vlm(server_factory: Any) -> Any:
    return server_factory("model=tiny_vlm", "media.max_request_pixels=60000000",
                          "server.max_body_mb=32")


def test_a_request_past_its_decoded_pixel_budget_is_a_400(vlm: Any) -> None:
    base = vlm.base_url
    ok = httpx.post(base + "/v1/chat/completions", json=_image_chat([_png((64, 48))]),
                    timeout=TIMEOUT)
    assert ok.status_code == 200, ok.text
    before = _rss_bytes(vlm.proc.pid)
    # 16 images of 6300x6300, each under media.max_image_pixels, 635 M pixels in all
    body = _image_chat([_png((6300, 6300))] * 16)
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]"
    assert "media.max_request_pixels" in err["message"] and "79380000" in err["message"]
    assert "limit is 60000000 per request" in err["message"]
    # refused from the headers: no image (119 MB each as RGB) was decoded, none is kept
    assert _rss_bytes(vlm.proc.pid) - before < 100_000_000
    again = httpx.post(base + "/v1/chat/completions", json=_image_chat([_png((64, 48))]),
                       timeout=TIMEOUT)
    assert again.status_code == 200, again.text


def test_an_image_slow_to_decode_is_a_400_and_frees_its_thread(vlm: Any) -> None:
    """A 2.5 MB progressive JPEG of 100,000 scans, each walking every block, ends at
    media.max_image_decode_s; a text chat sent meanwhile and images sent after are served."""
    import base64

    from tests.media_util import scan_bomb_jpeg
    bomb = base64.b64encode(scan_bomb_jpeg((6000, 6000), 100_000)).decode()
    base = vlm.base_url
    order: list[str] = []

    def send(name: str, body: dict[str, Any]) -> httpx.Response:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
        order.append(name)
        return r
    with ThreadPoolExecutor(1) as ex:
        slow = ex.submit(send, "image", _image_chat(["data:image/jpeg;base64," + bomb]))
        chat = send("text", {"model": "tiny_vlm", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Say something."}]})
        r = slow.result(timeout=300)
    assert chat.status_code == 200, chat.text[:300]
    assert order == ["text", "image"]
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[0]"
    assert "took longer than 10 s, the limit per image (media.max_image_decode_s)" in err["message"]
    for _ in range(3):   # both media threads are free again
        ok = httpx.post(base + "/v1/chat/completions", json=_image_chat([_png((64, 48))]),
                        timeout=TIMEOUT)
        assert ok.status_code == 200, ok.text


def test_a_data_url_type_must_match_its_bytes(vlm: Any) -> None:
    body = _image_chat([_png((32, 32)).replace("image/png", "image/jpeg")])
    r = httpx.post(vlm.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[0]"
    assert "declares image/jpeg but its bytes are a PNG image" in err["message"]


def test_other_formats_are_not_opened(vlm: Any) -> None:
    import base64
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    url = "data:image/png;base64," + base64.b64encode(eps).decode()
    r = httpx.post(vlm.base_url + "/v1/chat/completions", json=_image_chat([url]),
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert "could not be decoded" in r.json()["error"]["message"]


def test_a_text_chat_never_waits_behind_two_media_requests(vlm: Any) -> None:
    """Two requests that each decode two 29 M-pixel images hold the media threads; a 60 kB text
    chat (5,000 template variables: large enough to be prepared off the event loop, short in
    tokens) sent meanwhile is answered first."""
    base = vlm.base_url
    heavy = _image_chat([_png((5400, 5400), 40), _png((5400, 5400), 41)])
    text = {"model": "tiny_vlm", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}],
            "chat_template_kwargs": {f"unused_{i}": i for i in range(5000)}}
    order: list[str] = []

    def send(name: str, body: dict[str, Any]) -> httpx.Response:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
        order.append(name)
        return r
    with ThreadPoolExecutor(3) as ex:
        media = [ex.submit(send, f"media{i}", heavy) for i in range(2)]
        time.sleep(0.3)   # the media requests reach their threads first
        chat = send("text", text)
        results = [f.result(timeout=300) for f in media]
    assert chat.status_code == 200, chat.text[:300]
    assert [r.status_code for r in results] == [200, 200], [r.text[:200] for r in results]
    assert order[0] == "text", order


def test_mutated_images_through_the_server_are_never_5xx(vlm: Any) -> None:
    """A slice of the media fuzz (tests/vision/test_media_fuzz.py) end to end: each answer is
    a 200 or a 400 naming the part, and a valid request beside them is served."""
    import base64
    import io
    import random

    from PIL import Image

    from tests.vision.test_media_fuzz import IMAGE_FORMATS, mutations
    rng = random.Random(44)
    statuses: dict[int, int] = {}
    for fmt in IMAGE_FORMATS:
        buf = io.BytesIO()
        Image.new("RGB", (32, 24), (rng.randrange(256), 40, 90)).save(buf, format=fmt)
        for data in mutations(buf.getvalue(), rng, 8):
            url = "data:image/*;base64," + base64.b64encode(data).decode()
            r = httpx.post(vlm.base_url + "/v1/chat/completions", json=_image_chat([url]),
                           timeout=TIMEOUT)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "messages[0].content[0]", r.text
    assert set(statuses) <= {200, 400} and sum(statuses.values()) == 8 * len(IMAGE_FORMATS)
    ok = httpx.post(vlm.base_url + "/v1/chat/completions", json=_image_chat([_png((64, 48))]),
                    timeout=TIMEOUT)
    assert ok.status_code == 200, ok.text


# -- the active-rows gauge follows aborts ---------------------------------------------------
def _gauge(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=TIMEOUT).text
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def test_active_rows_falls_to_zero_when_every_row_is_cancelled(keyed: Any) -> None:
    from tests.serve.test_openai import NO_EOS
    base = keyed.base_url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}],
            "max_tokens": 2000, "logit_bias": NO_EOS, "stream": True}

    def cut() -> None:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda _: cut(), range(4)))
    for _ in range(300):   # bounded: until the engine has let every row go
        if httpx.get(base + "/health", timeout=TIMEOUT).json()["inflight"] == 0:
            break
        time.sleep(0.05)
    assert httpx.get(base + "/health", timeout=TIMEOUT).json()["inflight"] == 0
    for _ in range(20):   # the gauge is set on the engine thread just after the last abort
        if _gauge(base, "pipeserve_active_rows") == 0:
            break
        time.sleep(0.05)
    assert _gauge(base, "pipeserve_active_rows") == 0   # it kept 4 until the next step


# -- priority above the default is granted, not self-asserted --------------------------------
def test_an_urgent_priority_needs_the_admin_key(keyed: Any) -> None:
    base = keyed.base_url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    for priority in (0, "interactive", 4):
        r = httpx.post(base + "/v1/chat/completions", json={**body, "priority": priority},
                       headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and err["code"] == "priority_not_granted"
        assert "only requests with server.admin_key may ask for it" in err["message"]
    for priority in (5, "default", "batch", 9):   # the default class and later: anyone
        r = httpx.post(base + "/v1/chat/completions", json={**body, "priority": priority},
                       headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    r = httpx.post(base + "/v1/chat/completions", json={**body, "priority": 0},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text   # the admin key is granted every class


def test_tokenize_counts_image_tokens_as_the_chat_does(vlm: Any) -> None:
    body = _image_chat([_png((64, 48)), _png((40, 40), 3)], "Which is larger?")
    chat = httpx.post(vlm.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert chat.status_code == 200, chat.text
    counted = httpx.post(vlm.base_url + "/tokenize", json={"model": "tiny_vlm",
                                                          "messages": body["messages"]},
                         timeout=TIMEOUT)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    bad = httpx.post(vlm.base_url + "/tokenize", timeout=TIMEOUT, json={
        "model": "tiny_vlm", "messages": _image_chat(["data:image/png;base64,AAAA"])["messages"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[0]"
