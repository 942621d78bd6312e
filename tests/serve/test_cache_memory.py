"""Memory accounting that matches memory: after a storm of streams whose clients disconnect
mid-generation, MLX's active memory is what the prompt cache reports plus the running rows plus
the server's baseline (weights and the rest) — an entry never keeps a batch's or a
preallocated buffer alive that it does not count — and `cache.ram_gb` caps the real bytes."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, wait_health

STORM = 60          # streams, 8 at a time, each dropped after CUT tokens of max_tokens=2000
CONCURRENCY = 8
CUT = 20
RAM_GB = 0.008      # ~8.6 MB: the storm's entries (~200 kB each, ~12 MB) overflow it
TOLERANCE = 0.10


def memory(base_url: str) -> dict[str, float]:
    fams = metric_families(base_url)
    return {
        "active": sample_value(fams, "pipeserve_mlx_memory_bytes", "pipeserve_mlx_memory_bytes",
                               kind="active"),
        "cache": sample_value(fams, "pipeserve_prompt_cache_bytes",
                              "pipeserve_prompt_cache_bytes", cache_tier="ram"),
        "rows": sample_value(fams, "pipeserve_kv_bytes", "pipeserve_kv_bytes"),
        "entries": sample_value(fams, "pipeserve_prompt_cache_entries",
                                "pipeserve_prompt_cache_entries", cache_tier="ram"),
        "evictions": sample_value(fams, "pipeserve_prompt_cache_evictions",
                                  "pipeserve_prompt_cache_evictions_total", cache_tier="ram"),
        "capacity": sample_value(fams, "pipeserve_prompt_cache_capacity_bytes",
                                 "pipeserve_prompt_cache_capacity_bytes", cache_tier="ram"),
    }


async def dropped_stream(client: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> int:
    """A long greedy stream whose client goes away after CUT tokens."""
    body = {"model": "tiny", "prompt": f"cancel storm stream {i}: " + "lorem ipsum " * 40,
            "max_tokens": 2000, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    got = 0
    async with gate, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                got += 1
                if got >= CUT:
                    break   # leaving the block closes the connection mid-generation
    return got


def storm(base_url: str, n: int, first: int = 0) -> list[int]:
    async def run() -> list[int]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(dropped_stream(client, first + i, gate) for i in range(n))), 120)
    return asyncio.run(run())


def settled(base_url: str) -> dict[str, float]:
    """Memory once every dropped row is gone. The engine samples MLX memory when it turns
    idle; one short request afterwards makes that sample follow the storm's last frees."""
    wait_health(base_url, inflight=0, waiting=0)
    time.sleep(0.5)
    r = httpx.post(base_url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200
    wait_health(base_url, inflight=0, waiting=0)
    time.sleep(0.5)
    return memory(base_url)


@pytest.fixture(scope="module")
def stormed(server_factory: Any) -> dict[str, Any]:
    server = server_factory("scheduler=continuous", "cache=ram", f"cache.ram_gb={RAM_GB}")
    storm(server.base_url, CONCURRENCY, first=10_000)   # warm-up: kernels, first allocations
    base = settled(server.base_url)
    base_active = base["active"] - base["cache"] - base["rows"]   # weights and the rest
    got = storm(server.base_url, STORM)
    return {"base_active": base_active, "got": got, "after": settled(server.base_url)}


def test_cancel_storm_memory_matches_the_accounting(stormed: dict[str, Any]) -> None:
    after = stormed["after"]
    assert all(n == CUT for n in stormed["got"])           # every stream was cut mid-way
    assert after["rows"] == 0                               # no dropped row kept its KV
    assert after["entries"] >= 1 and after["cache"] > 0     # what they computed is kept
    expected = stormed["base_active"] + after["cache"] + after["rows"]
    assert abs(after["active"] - expected) <= TOLERANCE * after["active"], (
        f"MLX active {after['active'] / 1e6:.2f} MB, accounted {expected / 1e6:.2f} MB "
        f"(baseline {stormed['base_active'] / 1e6:.2f} + cache {after['cache'] / 1e6:.2f} "
        f"+ rows {after['rows'] / 1e6:.2f})")


def test_ram_cap_bounds_the_real_bytes(stormed: dict[str, Any]) -> None:
    after = stormed["after"]
    cap = RAM_GB * (1 << 30)
    assert after["capacity"] == int(cap)
    assert after["evictions"] >= 1                          # the storm overflowed the cap
    assert after["cache"] <= cap
    assert after["active"] - stormed["base_active"] <= cap * (1 + TOLERANCE)


def test_a_prefix_larger_than_the_tier_is_said_and_counted_and_the_default_is_fitted(
        server_factory: Any) -> None:
    """A prompt whose KV alone passes cache.ram_gb is served, not kept (a warning naming
    cache.ram_gb, a counter), so its repeat is computed again; at the default the tier is
    fitted at load (the tiny model's context needs less than the 8 GiB floor)."""
    small = server_factory("cache=ram", "cache.ram_gb=0.00002")   # ~21 kB: one short prompt
    body = {"model": "tiny", "prompt": "a long prompt " * 40, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        r = httpx.post(small.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
    assert r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    fams = metric_families(small.base_url)
    assert sample_value(fams, "pipeserve_prompt_cache_too_large",
                        "pipeserve_prompt_cache_too_large_total", cache_tier="ram") >= 1
    assert "raise cache.ram_gb to keep it" in small.log()

    fitted = server_factory("cache=ram")
    for _ in range(2):
        r = httpx.post(fitted.base_url + "/v1/completions", json=body, timeout=60)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # kept: a hit
    assert memory(fitted.base_url)["capacity"] == 8 << 30
    assert "RAM tier 8.0 GiB (fitted: the least fitted size" in fitted.log()
