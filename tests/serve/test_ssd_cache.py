"""The SSD tier with real processes: entries survive SIGTERM restarts and kill -9, corrupt
entries are skipped and counted (never served), flush waits for the disk, RAM evictions
spill to disk, and SIGTERM lets requests in flight finish."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import diskcache
import httpx

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

LONG = "A long shared preamble about caches, disks and restarts. " * 30


def complete(base: str, prompt: str, n: int = 12) -> Any:
    return sdk(base).completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                        temperature=0, logit_bias=NO_EOS)


def counter(base: str, family: str, **labels: str) -> float:
    return sample_value(metric_families(base), family, family + "_total", **labels)


def start(server_factory: Any, cache_dir: Path, *extra: str) -> Any:
    return server_factory("cache=ssd", f"cache.ssd.dir={cache_dir}", *extra)


def test_entries_survive_a_restart_and_give_identical_tokens(server_factory, tmp_path) -> None:
    first = start(server_factory, tmp_path)
    cold = complete(first.base_url, LONG)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert first.stop() == 0                   # SIGTERM: drains, flushes, exits 0
    second = start(server_factory, tmp_path)
    warm = complete(second.base_url, LONG)
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert counter(second.base_url, "pipeserve_prompt_cache_hits", cache_tier="ssd") == 1
    assert counter(second.base_url, "pipeserve_prompt_cache_restores") == 1


def test_flush_waits_for_the_disk_and_honours_the_admin_key(server_factory, tmp_path) -> None:
    s = start(server_factory, tmp_path, "server.admin_key=adm", "cache.ssd.write_behind=false")
    complete(s.base_url, LONG + " flush")
    assert counter(s.base_url, "pipeserve_prompt_cache_ssd_writes") == 0   # nothing written yet
    assert httpx.post(s.base_url + "/admin/cache/flush", timeout=30).status_code == 401
    r = httpx.post(s.base_url + "/admin/cache/flush", timeout=60,
                   headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200 and r.json()["flushed"] is True
    assert counter(s.base_url, "pipeserve_prompt_cache_ssd_writes") >= 1
    s.stop()
    disk = diskcache.Cache(str(next(tmp_path.iterdir())))
    assert any(str(k).startswith("e:") for k in disk.iterkeys())   # on disk for real
    disk.close()


def test_corrupt_entries_are_skipped_counted_and_never_served(server_factory, tmp_path) -> None:
    s = start(server_factory, tmp_path)
    cold = complete(s.base_url, LONG)
    s.stop()
    disk = diskcache.Cache(str(next(tmp_path.iterdir())))
    keys = [k for k in disk.iterkeys() if str(k).startswith("e:")]
    assert keys
    for k in keys:                              # truncate every stored entry
        disk.set(k, disk.get(k)[:-100])
    disk.close()
    again = start(server_factory, tmp_path)
    out = complete(again.base_url, LONG)
    assert out.choices[0].text == cold.choices[0].text
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert counter(again.base_url, "pipeserve_prompt_cache_corrupt_entries") >= 1
    assert counter(again.base_url, "pipeserve_prompt_cache_restores") == 0


def test_kill_9_during_write_behind_never_serves_a_broken_entry(server_factory, tmp_path) -> None:
    prompts = [f"{i} " + LONG for i in range(3)]
    reference = [complete(start(server_factory, tmp_path / "ref").base_url, p).choices[0].text
                 for p in prompts[:1]]
    expected: dict[str, str] = {}
    for round_ in range(3):                     # bounded: three crash/restart cycles
        s = start(server_factory, tmp_path / "crash")
        for p in prompts:
            text = complete(s.base_url, p).choices[0].text
            assert expected.setdefault(p, text) == text
        s.proc.kill()                           # SIGKILL while entries are being written
        s.proc.wait(10)
    final = start(server_factory, tmp_path / "crash")
    for p in prompts:
        assert complete(final.base_url, p).choices[0].text == expected[p]
    assert expected[prompts[0]] == reference[0]


def test_ram_evictions_spill_to_disk_and_come_back(server_factory, tmp_path) -> None:
    # one ~1k-token entry (about 0.5 MB of float32 KV) fits in RAM, two do not
    s = start(server_factory, tmp_path, "cache.ram_gb=0.0007", "cache.ssd.write_behind=false")
    prompts = [f"{i} " + LONG for i in range(4)]
    cold = [complete(s.base_url, p).choices[0].text for p in prompts]
    assert counter(s.base_url, "pipeserve_prompt_cache_spills", reason="eviction") >= 1
    again = complete(s.base_url, prompts[0])
    assert again.choices[0].text == cold[0]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert counter(s.base_url, "pipeserve_prompt_cache_hits", cache_tier="ssd") >= 1


def test_sigterm_lets_requests_in_flight_finish(server_factory, tmp_path) -> None:
    s = start(server_factory, tmp_path)
    result: dict[str, Any] = {}

    def run() -> None:
        result["r"] = complete(s.base_url, "go on and on", n=2500)

    t = threading.Thread(target=run)
    t.start()
    for _ in range(400):                        # bounded wait until it is decoding
        if httpx.get(s.base_url + "/health", timeout=5).json().get("inflight"):
            break
        threading.Event().wait(0.02)
    code = s.stop()
    t.join(60)
    assert code == 0
    assert result["r"].usage.completion_tokens == 2500
    assert result["r"].choices[0].finish_reason == "length"


def test_entries_of_another_model_never_load_and_the_miss_says_why(server_factory,
                                                                   tmp_path) -> None:
    """The generated llama shares the tiny qwen3's tokenizer, so the same prompt has the same
    tokens, but its KV would be meaningless: it lives under another identity."""
    s = start(server_factory, tmp_path)
    complete(s.base_url, LONG)
    s.stop()
    other = start(server_factory, tmp_path, "model=llama")
    out = complete(other.base_url, LONG)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert counter(other.base_url, "pipeserve_prompt_cache_misses", reason="incompatible") == 1
    assert counter(other.base_url, "pipeserve_prompt_cache_restores") == 0
