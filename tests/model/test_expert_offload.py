"""Expert offload (model.expert_offload): a generated mixture-of-experts checkpoint (mlx-lm's
qwen3_moe, float and 4-bit) served with its experts mapped from disk and a hot-expert cache far
smaller than them decodes exactly the tokens the fully loaded model decodes — through the real
loader and engine, several rows at once, and through the server with the OpenAI SDK, whose
/metrics count the cache's hits, misses and bytes moved. What cannot be offloaded is refused."""
from __future__ import annotations

import asyncio
import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import openai
import pytest

from pipeserve.errors import ConfigError
from pipeserve.model.config import ModelConfig
from pipeserve.model.experts import HotExperts, _Slots, expert_bytes, offload
from pipeserve.model.fit import estimate
from pipeserve.model.loader import load
from pipeserve.model.tiny.moe import MoeShape, ensure_moe_model
from tests.conftest import ROOT, make_config
from tests.serve.test_openai import metric_families, sample_value

PROMPTS = [[5, 17, 260, 3, 99, 400, 12, 7], [40, 41, 42], [300, 2, 250, 9, 9, 9, 100]]
CACHE_MB = 0.2   # MB: a quarter of the float experts (0.79 MB), more than one layer's use


def greedy(engine: Any, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    reqs = []
    for p in prompts:
        req = engine.request(p, max_tokens=n)
        req.stop_token_ids = frozenset()   # random weights: decode all n
        reqs.append(req)
    return [r["ids"] for r in asyncio.run(engine.generate_many(reqs))]


@pytest.mark.parametrize(("bits", "cache_mb"), [(None, CACHE_MB), (4, 0.12)],
                         ids=["float32", "q4"])
def test_offloaded_experts_decode_what_the_loaded_model_decodes(
        engine_factory: Any, model_cache: Path, bits: int | None, cache_mb: float) -> None:
    path = ensure_moe_model(MoeShape(bits=bits), model_cache)
    args = ("model=llama", f"model.path={path}", "model.compute_dtype=checkpoint",
            "model.use_generation_config=false")
    want = greedy(engine_factory(*args), PROMPTS)
    offloaded = engine_factory(*args, "model.expert_offload=true",
                               f"model.expert_cache_mb={cache_mb}")
    assert greedy(offloaded, PROMPTS) == want   # three rows batched together
    assert [greedy(offloaded, [p])[0] for p in PROMPTS] == want   # and one at a time
    loaded = offloaded.engine.loaded
    cache = loaded.experts
    assert cache.total > 2 * cache.capacity   # the experts do not fit in the cache
    assert cache.stats.misses > 0 and cache.stats.evictions > 0 and cache.stats.hits > 0
    assert cache.stats.bytes_moved > cache.total   # experts came back after being evicted
    # admission counts the cache, not every expert; `pipeserve fit` says the same
    fit = estimate(make_config(f"model.cache_dir={model_cache}", *args,
                               "model.expert_offload=true", f"model.expert_cache_mb={cache_mb}"))
    assert fit.memory == offloaded.engine.memory
    assert fit.experts == (cache.capacity, cache.total)
    assert "the experts mapped from disk" in fit.lines()[1]
    assert offloaded.engine.memory.weight_bytes == (
        engine_factory(*args).engine.memory.weight_bytes - cache.total + cache.capacity)


def test_a_layer_served_dequantized_reads_its_experts_dequantized(model_cache: Path) -> None:
    """model.compute_dtype=auto with a BLAS on the CPU serves 4-bit layers as float32: the
    offloaded experts are dequantized as they are read, as the loader dequantized the rest."""
    from mlx_lm.utils import dequantize_model, load_model

    path = ensure_moe_model(MoeShape(bits=4), model_cache)
    full, config = load_model(path)
    dequantize_model(full)
    lazy, _ = load_model(path, lazy=True)
    dequantize_model(lazy)
    cache = offload(lazy, path, config, CACHE_MB)
    ids = mx.array([PROMPTS[0] * 3])
    np.testing.assert_array_equal(np.array(lazy(ids)), np.array(full(ids)))
    assert cache.stats.misses > 0 and expert_bytes(lazy) == 0


def test_what_cannot_be_offloaded_is_refused(model_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no stacked expert layers"):
        load(ModelConfig(name="t", cache_dir=str(model_cache), expert_offload=True))
    with pytest.raises(ConfigError, match="expert_cache_mb=0"):
        ModelConfig(name="t", expert_offload=True, expert_cache_mb=0)
    with pytest.raises(ConfigError, match="LoRA adapters"):
        ModelConfig(name="t", expert_offload=True, adapter_dir=str(tmp_path), adapter="a")


def test_the_server_serves_an_offloaded_model_and_counts_the_cache(
        server_factory: Any, model_cache: Path) -> None:
    path = ensure_moe_model(MoeShape(), model_cache)
    srv = server_factory("model=llama", f"model.path={path}", "model.expert_offload=true",
                         f"model.expert_cache_mb={CACHE_MB}", "model.compute_dtype=checkpoint")
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    out = client.completions.create(model="llama", prompt="Where are my keys?", max_tokens=8,
                                    temperature=0)
    assert out.usage.completion_tokens > 0
    fams = metric_families(srv.base_url)
    misses = sample_value(fams, "pipeserve_expert_cache_lookups",
                          "pipeserve_expert_cache_lookups_total", result="miss")
    hits = sample_value(fams, "pipeserve_expert_cache_lookups",
                        "pipeserve_expert_cache_lookups_total", result="hit")
    moved = sample_value(fams, "pipeserve_expert_bytes_moved", "pipeserve_expert_bytes_moved_total")
    held = sample_value(fams, "pipeserve_expert_cache_bytes", "pipeserve_expert_cache_bytes")
    assert misses > 0 and hits >= 0 and moved > 0 and 0 < held


def test_the_benchmark_script_writes_its_table(tmp_path: Path) -> None:
    """scripts/expert_offload_bench.py (the benchmarks page's table), at its --quick size."""
    out = tmp_path / "bench.csv"
    subprocess.run([sys.executable, "scripts/expert_offload_bench.py", str(out), "--quick"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    rows = list(csv.DictReader(out.open()))
    assert [r["cache"] for r in rows] == ["all loaded", "50% of the experts"]
    loaded, offloaded = rows
    assert float(offloaded["weights_mb"]) < float(loaded["weights_mb"])
    assert float(offloaded["decode_tok_s"]) > 0 and 0 <= float(offloaded["hit_rate"]) <= 1


def test_the_expert_routed_least_often_lately_gives_up_its_slot() -> None:
    """Eviction by routing frequency: an expert routed on most steps keeps its slot through a
    burst of others; one the step needs is never evicted; between equals the least recently
    routed goes."""
    slots = _Slots({}, HotExperts(0), experts=8, expert_size=1, slots=2)
    for _ in range(10):
        slots.routed([1])
    slots.routed([2])
    slots.slot_of.update({1: 0, 2: 1})   # 2 routed last, but once
    assert slots._free_slot(keep=set()) == 1 and list(slots.slot_of) == [1]
    slots.slot_of[2] = 1
    assert slots._free_slot(keep={2}) == 0 and list(slots.slot_of) == [2]
    equal = _Slots({}, HotExperts(0), experts=8, expert_size=1, slots=2)
    equal.routed([6])
    equal.routed([7])
    equal.slot_of.update({6: 0, 7: 1})
    equal.routings[6] = equal.routings[7]   # the same count: 6, routed earlier, goes
    assert equal._free_slot(keep=set()) == 0
