"""KV layouts through the real server: kv=paged answers exactly as kv=dense, kv=turbo serves
at its smaller bytes per token, and each response's record names the layout."""
from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

TEXT = "Tell me about the morning train that left the station at seven. " * 4


def chat(base: str) -> Any:
    return sdk(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": TEXT}], max_tokens=20,
        temperature=0, logit_bias=NO_EOS)


def per_token(base: str) -> float:
    return sample_value(metric_families(base), "pipeserve_kv_bytes_per_token",
                        "pipeserve_kv_bytes_per_token")


def test_layouts_over_http(server_factory) -> None:
    dense = server_factory("kv=dense")
    expected = chat(dense.base_url)
    dense_bytes = per_token(dense.base_url)
    dense.stop()
    paged = server_factory("kv=paged", "kv.block_size=16")
    got = chat(paged.base_url)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage.model_extra["pipeserve"]["kv_scheme"] == "paged"
    used = sample_value(metric_families(paged.base_url), "pipeserve_kv_pool_blocks",
                        "pipeserve_kv_pool_blocks", state="used")
    assert used > 0   # the cached prompt + output hold blocks
    paged.stop()
    turbo = server_factory("kv=turbo", "kv.v_bits=4")
    out = chat(turbo.base_url)
    assert out.usage.completion_tokens == 20
    assert out.usage.model_extra["pipeserve"]["kv_scheme"] == "turbo"
    assert per_token(turbo.base_url) < dense_bytes


def test_a_request_larger_than_the_paged_pool_is_refused_and_the_server_goes_on(
        server_factory) -> None:
    s = server_factory("kv=paged", "kv.block_size=16", "kv.pool_blocks=8")   # 128 tokens
    client = sdk(s.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 200, max_tokens=20)
    body = e.value.body
    assert body["type"] == "memory_admission" and body["code"] == "kv_over_budget"
    assert "128 tokens" in body["message"] and body["param"] == "max_tokens"
    small = client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                      logit_bias=NO_EOS)
    assert small.usage.completion_tokens == 8
