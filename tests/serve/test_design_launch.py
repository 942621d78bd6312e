"""The design card's launch, `python serve.py model=qwen kv=turbo draft=mtp`, through the real
server: concurrent OpenAI SDK requests batch, all complete, `usage.speculation` counts the MTP
head's drafts, and the record names kv=turbo and draft=mtp. model=qwen without a path is the
generated Qwen3.5 stand-in (recurrent + attention layers, head_dim 64, an MTP head), on which
the other KV layouts start too."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

PROMPTS = [f"Request {i}: tell me about the morning train that left the station at seven."
           for i in range(8)]


def chat(base: str, text: str, n: int = 32) -> Any:
    return sdk(base).chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": text}], max_tokens=n,
        temperature=0, logit_bias=NO_EOS)


@pytest.fixture(scope="module")
def design(server_factory: Any) -> Any:
    return server_factory("model=qwen", "kv=turbo", "draft=mtp")


def test_design_card_launch_serves_batched_requests_with_speculation(design: Any) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: chat(design.base_url, p), PROMPTS))
    assert all(r.usage.completion_tokens == 32 for r in results)
    assert all(r.choices[0].finish_reason == "length" and r.choices[0].message.content
               for r in results)
    for r in results:
        spec = r.usage.model_extra["speculation"]
        assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
        record = r.usage.model_extra["pipeserve"]
        assert record["kv_scheme"] == "turbo" and record["draft"] == "mtp"
    assert sum(r.usage.model_extra["speculation"]["accepted"] for r in results) > 0
    assert max(r.usage.model_extra["pipeserve"]["batch_size"] for r in results) > 1   # batched
    fams = metric_families(design.base_url)
    assert sample_value(fams, "pipeserve_speculation_accepted_tokens",
                        "pipeserve_speculation_accepted_tokens_total", proposer="mtp") > 0
    assert "draft=mtp: 1 MTP layer(s) loaded" in design.log()


def test_design_card_output_equals_plain_decoding(design: Any, server_factory: Any) -> None:
    """Lossless: the same greedy request without drafting, under the same kv, is identical."""
    drafted = chat(design.base_url, PROMPTS[0], 40)
    plain = server_factory("model=qwen", "kv=turbo")
    expected = chat(plain.base_url, PROMPTS[0], 40)
    assert "speculation" not in (expected.usage.model_extra or {})
    assert drafted.choices[0].message.content == expected.choices[0].message.content
    assert plain.stop() == 0


@pytest.mark.parametrize("kv", ["q8", "q4", "paged"])
def test_every_kv_layout_starts_on_model_qwen(server_factory: Any, kv: str) -> None:
    s = server_factory("model=qwen", f"kv={kv}", "draft=mtp")
    r = chat(s.base_url, PROMPTS[1], 16)
    assert r.usage.completion_tokens == 16
    assert r.usage.model_extra["pipeserve"]["kv_scheme"] == kv
    assert r.usage.model_extra["speculation"]["proposed"] > 0
    assert s.stop() == 0
