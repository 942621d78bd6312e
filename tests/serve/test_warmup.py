"""Idle warm-up through a real server: after a chat turn on a template whose generation
prompt differs from how the next turn renders the history (Qwen3, thinking off), the idle
engine prefills the history with the answer, so turn 2 reads the answer from the cache
instead of recomputing it (without warm-up nothing cached reaches past turn 1's prompt)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.serve.test_agent_sessions import SYSTEM, TEMPLATES
from tests.serve.test_openai import NO_EOS, TIMEOUT, metric_families, sample_value


def chat(base: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(base + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "logit_bias": NO_EOS, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    return r.json()


def warmups(base: str, outcome: str) -> float:
    return sample_value(metric_families(base), "pipeserve_warmups", "pipeserve_warmups_total",
                        outcome=outcome)


def two_turns(base: str, wait_warmup: bool) -> tuple[int, int]:
    """(turn 1's prompt tokens, turn 2's cached tokens)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Step 1."}]
    first = chat(base, messages, 24)
    if wait_warmup:
        deadline = time.monotonic() + 20   # bounded: the idle engine runs the warm-up
        while warmups(base, "done") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert warmups(base, "done") == 1
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Step 2."}]
    second = chat(base, messages, 2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first["usage"]["prompt_tokens"], cached


def test_warm_up_puts_the_answer_in_the_cache_for_turn_2(server_factory: Any,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "qwen3.jinja"
    path.write_text(TEMPLATES["qwen3"])
    warm = server_factory(f"model.chat_template={path}", "cache.warmup_budget_tokens=256")
    prompt_1, cached = two_turns(warm.base_url, wait_warmup=True)
    # turn 2 leaves turn 1's prompt inside its generation prompt (the empty think span), so
    # without the warm-up nothing cached reaches past turn 1's prompt; with it, turn 2 reads
    # the whole rendered answer too
    assert cached > prompt_1
    assert sample_value(metric_families(warm.base_url), "pipeserve_warmup_tokens",
                        "pipeserve_warmup_tokens_total") > 0
    # a real request after it found nothing in its way: both turns answered, none cancelled
    assert warmups(warm.base_url, "failed") == 0


def test_real_work_cancels_a_running_warm_up(server_factory: Any, tmp_path: Path) -> None:
    """One prompt token a step makes the warm-up of a 1000-token answer last ~1000 steps (a
    second or more): a real request sent while it runs cancels it and is answered."""
    path = tmp_path / "qwen3.jinja"
    path.write_text(TEMPLATES["qwen3"])
    srv = server_factory(f"model.chat_template={path}", "cache.warmup_budget_tokens=4096",
                         "scheduler.prefill_chunk=1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
    chat(srv.base_url, messages, 1000)
    deadline = time.monotonic() + 20   # bounded: until the warm-up is the one thing in flight
    while time.monotonic() < deadline:
        if httpx.get(srv.base_url + "/health", timeout=TIMEOUT).json()["inflight"] == 1:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the warm-up never started")
    assert chat(srv.base_url, [{"role": "user", "content": "Now."}], 3)["usage"][
        "completion_tokens"] == 3
    deadline = time.monotonic() + 20
    while warmups(srv.base_url, "cancelled") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmups(srv.base_url, "cancelled") == 1   # (the real turn then warms its own)
