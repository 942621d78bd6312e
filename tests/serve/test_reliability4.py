"""End to end, issue 44 (reliability, round 4), on real `serve.py` processes on 127.0.0.1: the API
key guards every route of the route table with or without a trailing slash. Every request has a
timeout; every wait is bounded."""
from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.conftest import make_config

TIMEOUT = 30.0
KEY = "round4-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# routes anyone may read: liveness, the chat page and its icons (metrics_auth is off here)
PUBLIC = {"/health", "/metrics", "/", "/favicon.ico", "/favicon.svg"}


@pytest.fixture(scope="module")
def keyed(server_factory: Any) -> Any:
    return server_factory(f"server.api_key={KEY}")


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
