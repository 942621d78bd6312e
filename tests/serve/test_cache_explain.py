"""Cache misses explained through a real server: `usage.prompt_tokens_details` carries
`cache_miss_reason` (cold, evicted with the entry's age, diverged_at with the token index and
the differing spans, adapter, kv_scheme, too_short) and /metrics counts them by reason."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.adapters.test_adapters import write_adapter
from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sample_value, sdk

# tiny float32: 2 KV layers x 2 heads x 16 dims x (K + V) x 4 bytes = 512 bytes a token; 160 kB
# hold a few 60-token prompts, so a flood of other prompts evicts the first
RAM_GB = 160e3 / (1 << 30)


def ids(seed: int, n: int = 60) -> list[int]:
    return [3 + (seed * 37 + i * 11) % 250 for i in range(n)]


@pytest.fixture(scope="module")
def srv(server_factory: Any, tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Any:
    """An adapter mounted, and a RAM tier small enough to evict."""
    adapters = tmp_path_factory.mktemp("adapters")
    write_adapter(adapters, "lora", ensure_model(cache_dir=model_cache), rank=4, seed=5)
    return server_factory(f"cache.ram_gb={RAM_GB}", f"model.adapter_dir={adapters}",
                          "model.adapters=[lora]")


@pytest.fixture(scope="module")
def q8_over_dense(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """kv=turbo over an SSD directory a kv=dense server wrote first (prompt ids(99))."""
    ssd = tmp_path_factory.mktemp("ssd")
    dense = server_factory("cache=ssd", f"cache.ssd.dir={ssd}")
    complete(dense.base_url, ids(99))
    dense.stop()   # flushes its entries to disk
    return server_factory("cache=ssd", f"cache.ssd.dir={ssd}", "kv=turbo", "kv.v_bits=4")


def complete(base: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    r = httpx.post(base + "/v1/completions", timeout=TIMEOUT, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "logit_bias": NO_EOS, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]


def reasons(base: str) -> dict[str, float]:
    fams = metric_families(base)
    return {r: sample_value(fams, "pipeserve_prompt_cache_recomputes",
                            "pipeserve_prompt_cache_recomputes_total", reason=r)
            for r in ("cold", "evicted", "diverged_at", "adapter", "kv_scheme", "too_short")}


def test_cold_then_a_full_hit_has_no_reason(srv: Any) -> None:
    before = reasons(srv.base_url)
    first = complete(srv.base_url, ids(1))
    assert first["cache_miss_reason"] == "cold" and first["cached_tokens"] == 0
    again = complete(srv.base_url, ids(1))
    assert again["cached_tokens"] == 59 and "cache_miss_reason" not in again
    assert reasons(srv.base_url)["cold"] == before["cold"] + 1


def test_diverged_at_names_the_index_and_the_spans(srv: Any) -> None:
    base = ids(2)
    complete(srv.base_url, base)
    other = base[:40] + ids(3, 20)
    details = complete(srv.base_url, other)
    assert details["cached_tokens"] == 40
    miss = details["cache_miss"]
    assert details["cache_miss_reason"] == "diverged_at" and miss["index"] == 40
    assert miss["prompt_span"] != miss["cached_span"] and miss["context"]


def test_sdk_reads_the_reason_in_each_protocol(srv: Any) -> None:
    chat = sdk(srv.base_url).chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "unique words " * 9}])
    assert chat.usage.prompt_tokens_details.model_extra["cache_miss_reason"] in (
        "cold", "diverged_at")
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0,
                                 timeout=TIMEOUT)
    msg = client.messages.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "other unique words " * 9}])
    assert msg.usage.model_extra["cache_miss_reason"] in ("cold", "diverged_at")


def test_too_short(srv: Any) -> None:
    details = complete(srv.base_url, [7])
    assert details["cache_miss_reason"] == "too_short"
    assert details["cache_miss"]["prompt_tokens"] == 1


def test_other_adapter(srv: Any) -> None:
    prompt = ids(4)
    complete(srv.base_url, prompt, adapter="lora")
    details = complete(srv.base_url, prompt)
    assert details["cache_miss_reason"] == "adapter"
    assert details["cache_miss"]["entry_adapter"] == "lora"


def test_kv_scheme_of_an_ssd_entry(q8_over_dense: Any) -> None:
    details = complete(q8_over_dense.base_url, ids(99))
    assert details["cache_miss_reason"] == "kv_scheme", details
    assert details["cache_miss"]["entry_kv_scheme"] == "dense"
    assert details["cache_miss"]["kv_scheme"] == "turbo"


def test_evicted_reports_the_entry_age(srv: Any) -> None:
    before = reasons(srv.base_url)
    first = ids(5)
    complete(srv.base_url, first)
    for seed in range(10, 20):   # a flood of other prompts evicts it
        complete(srv.base_url, ids(seed))
    details = complete(srv.base_url, first)
    assert details["cached_tokens"] == 0
    assert details["cache_miss_reason"] == "evicted", details
    assert details["cache_miss"]["age_s"] >= details["cache_miss"]["evicted_s_ago"] >= 0
    assert reasons(srv.base_url)["evicted"] == before["evicted"] + 1
