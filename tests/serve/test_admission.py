"""Memory admission end to end: advisory publishes estimates and never rejects; budget mode
rejects a prompt with no room (400 memory_admission/context_over_budget) and clamps
max_tokens; a KV budget queues a joiner until rows finish and rejects one that cannot fit."""
from __future__ import annotations

import math
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk, wait_health

KV_PER_TOKEN = 512   # tiny float32 model: 2 layers x (K+V) x 2 kv heads x 16 dims x 4 bytes


def gauge(base_url: str, name: str) -> float:
    return sample_value(metric_families(base_url), name, name)


def test_advisory_publishes_estimates_and_never_shortens(server: Any) -> None:
    assert gauge(server.base_url, "pipeserve_kv_bytes_per_token") == KV_PER_TOKEN
    safe = gauge(server.base_url, "pipeserve_admission_max_safe_context_tokens")
    assert safe > 1000
    assert math.isnan(gauge(server.base_url, "pipeserve_admission_context_cap_tokens"))
    out = sdk(server.base_url).completions.create(
        model="tiny", prompt="hello " * 50, max_tokens=600, logit_bias=NO_EOS, temperature=0)
    assert out.usage.completion_tokens == 600


@pytest.fixture(scope="module")
def budget(server_factory: Any) -> Any:
    # weights 427,520 B + prefill temporaries of a 64-token chunk 327,680 B leave
    # 244,800 B of the 1 MB budget: 478 tokens of KV at 512 B/token.
    return server_factory("admission=budget", "admission.memory_budget_gb=0.001",
                          "scheduler.prefill_chunk=64")


def test_budget_rejects_a_prompt_with_no_room_and_clamps_max_tokens(budget: Any) -> None:
    cap = gauge(budget.base_url, "pipeserve_admission_context_cap_tokens")
    assert cap == gauge(budget.base_url, "pipeserve_admission_max_safe_context_tokens") == 478
    client = sdk(budget.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=list(range(3, 3 + 500)), max_tokens=4)
    err = e.value.response.json()["error"]
    assert err["type"] == "memory_admission" and err["code"] == "context_over_budget"
    assert err["param"] == "prompt"   # the completions request's own field
    assert "500" in err["message"] and "478" in err["message"]
    out = client.completions.create(model="tiny", prompt=list(range(3, 3 + 400)),
                                    max_tokens=1000, logit_bias=NO_EOS, temperature=0)
    assert out.usage.completion_tokens == 78 and out.choices[0].finish_reason == "length"
    fams = metric_families(budget.base_url)
    assert sample_value(fams, "pipeserve_admission_decisions", "pipeserve_admission_decisions_total",
                        decision="clamped", reason="context_over_budget") >= 1
    assert sample_value(fams, "pipeserve_admission_decisions", "pipeserve_admission_decisions_total",
                        decision="rejected", reason="context_over_budget") >= 1


@pytest.fixture(scope="module")
def kv_budget(server_factory: Any) -> Any:
    # 2 MB of KV: one row of 20 + 3000 tokens (1.55 MB) fits, two do not.
    return server_factory("admission=budget", "admission.kv_budget_gb=0.002")


def first_then_joiner(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`body` sent twice: the second once the first runs. Both answers by name, and /health
    as it was once both were in (the joiner's wait, if it waited)."""
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        results[name] = httpx.post(base + "/v1/completions", json=body, timeout=120).json()

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert wait_health(base, 30, inflight=1)["inflight"] == 1
    second = threading.Thread(target=run, args=("second",))
    second.start()
    seen = wait_health(base, 30, inflight=2, waiting=1)
    first.join(120)
    second.join(120)
    return results, seen


def test_kv_budget_queues_a_joiner_then_admits_it(kv_budget: Any) -> None:
    base = kv_budget.base_url
    results, seen = first_then_joiner(base, {
        "model": "tiny", "prompt": list(range(3, 23)), "max_tokens": 3000,
        "logit_bias": NO_EOS, "temperature": 0})
    assert seen["waiting"] == 1     # the joiner waited for the first row's KV
    assert results["first"]["usage"]["completion_tokens"] == 3000
    assert results["second"]["usage"]["completion_tokens"] == 3000
    assert gauge(base, "pipeserve_kv_reserved_bytes") == 0
    assert gauge(base, "pipeserve_kv_budget_bytes") == 2_000_000


def test_kv_budget_rejects_what_cannot_fit_alone(kv_budget: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk(kv_budget.base_url).completions.create(model="tiny", prompt="hi", max_tokens=4000)
    err = e.value.response.json()["error"]
    assert err["type"] == "memory_admission" and err["code"] == "kv_over_budget"
    assert err["param"] == "max_tokens"


@pytest.fixture(scope="module")
def memory_gated(server_factory: Any) -> Any:
    # a ceiling of a millionth of MLX's memory limit: under the weights alone, so while a row
    # runs, no other joins (a stand-in for a GPU whose memory a burst would fill)
    return server_factory("admission.memory_high_water=0.000001")


def test_the_memory_gate_queues_a_joiner_and_changes_no_output(memory_gated: Any,
                                                               server: Any) -> None:
    base = memory_gated.base_url
    body = {"model": "tiny", "prompt": list(range(3, 23)), "max_tokens": 2000,
            "logit_bias": NO_EOS, "temperature": 0}
    results, seen = first_then_joiner(base, body)
    assert seen["waiting"] == 1   # the joiner waited for memory, not for a row slot
    plain = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
    for name in ("first", "second"):
        assert results[name]["usage"]["completion_tokens"] == 2000
        assert results[name]["choices"][0]["text"] == plain["choices"][0]["text"]
    assert sample_value(metric_families(base), "pipeserve_memory_waits",
                        "pipeserve_memory_waits_total") == 1
    log = memory_gated.log()
    assert "new rows wait while MLX's active memory would pass" in log
    assert "1 request(s) waited for a row" in log
