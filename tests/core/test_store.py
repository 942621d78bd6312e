"""ResponseStore: byte cap with LRU eviction, time to live, oversize entries refused."""
from __future__ import annotations

import time

import orjson

from pipeserve.http.api.store import ResponseStore


def entry(n: int) -> tuple[dict[str, object], list[dict[str, object]]]:
    return {"id": "x", "pad": "a" * n}, [{"role": "user", "content": "b" * n}]


def size(n: int) -> int:
    body, conv = entry(n)
    return len(orjson.dumps(body)) + len(orjson.dumps(conv))


def test_byte_cap_evicts_least_recently_used() -> None:
    store = ResponseStore(ttl_s=60, max_bytes=3 * size(100))
    for key in ("a", "b", "c"):
        assert store.put(key, *entry(100))
    assert store.nbytes == 3 * size(100) and len(store) == 3
    assert store.get("a") is not None          # a is now the most recent
    assert store.put("d", *entry(100))
    assert store.get("b") is None               # the least recently used went
    assert [k for k in "acd" if store.get(k) is not None] == ["a", "c", "d"]
    assert store.nbytes <= store.max_bytes


def test_an_entry_over_the_cap_is_not_stored() -> None:
    store = ResponseStore(ttl_s=60, max_bytes=size(100))
    assert store.put("a", *entry(10))
    assert not store.put("big", *entry(1000))
    assert store.get("big") is None and store.get("a") is not None
    assert not ResponseStore(ttl_s=60, max_bytes=0).put("a", *entry(1))


def test_an_entry_json_cannot_write_is_not_stored() -> None:
    """Nested past orjson's 254 levels: not stored (the caller logs it), never an exception
    after the response was generated."""
    deep: object = 0
    for _ in range(300):
        deep = {"a": deep}
    store = ResponseStore(ttl_s=60, max_bytes=1 << 20)
    assert not store.put("deep", {"id": "deep", "tools": [deep]}, [])
    assert store.get("deep") is None and len(store) == 0 and store.nbytes == 0
    assert store.put("a", *entry(10))


def test_entries_expire_after_the_ttl() -> None:
    store = ResponseStore(ttl_s=0.05, max_bytes=10**6)
    store.put("a", *entry(10))
    assert store.get("a") is not None
    deadline = time.monotonic() + 5
    while store.get("a") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get("a") is None and store.nbytes == 0


def test_delete_and_replace() -> None:
    store = ResponseStore(ttl_s=60, max_bytes=10**6)
    store.put("a", *entry(10))
    store.put("a", *entry(20))
    assert len(store) == 1 and store.nbytes == size(20)
    assert store.delete("a") and not store.delete("a") and store.nbytes == 0
