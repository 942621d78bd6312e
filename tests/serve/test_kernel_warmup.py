"""Kernel warm-up at launch (scheduler.kernel_warmup) through a real server: the server runs its
own requests before it reports ready, and a user sees nothing of them — no request, token or
TTFT in the metrics, no prompt-cache entry, nothing in flight — and the first answers are the
ones a server without the warm-up gives."""
from __future__ import annotations

from typing import Any

import httpx

from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sample_value

PROMPTS = ["Count to five.", "Name a colour."]


def answers(base: str) -> list[tuple[str, int]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(base + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "temperature": 0, "logit_bias": NO_EOS})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["choices"][0]["message"]["content"],
                    body["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def test_kernel_warmup_runs_before_ready_and_leaves_no_trace(server_factory: Any) -> None:
    warm = server_factory("scheduler=continuous", "scheduler.kernel_warmup=true")
    cold = server_factory("scheduler=continuous", "scheduler.kernel_warmup=false")
    log = warm.log()
    assert "kernel warm-up: " in log and "failed" not in log.split("kernel warm-up: ")[1][:80]
    assert "kernel warm-up" not in cold.log()
    fams = metric_families(warm.base_url)
    for family, sample in (("pipeserve_prompt_tokens", "pipeserve_prompt_tokens_total"),
                           ("pipeserve_generation_tokens", "pipeserve_generation_tokens_total"),
                           ("pipeserve_time_to_first_token_seconds",
                            "pipeserve_time_to_first_token_seconds_count")):
        assert family in fams, sorted(fams)
        assert sample_value(fams, family, sample) == 0, family
    assert sample_value(fams, "pipeserve_prompt_cache_entries", "pipeserve_prompt_cache_entries") == 0
    assert "pipeserve_prompt_cache_entries" in fams
    health = httpx.get(warm.base_url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok", health
    # greedy answers equal the server without the warm-up; nothing of it was in the cache
    # (the first prompt reuses nothing, the second only what the first left)
    assert answers(warm.base_url) == answers(cold.base_url)
