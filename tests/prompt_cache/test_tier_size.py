"""The RAM tier's size: an entry larger than the whole tier is never copied (on real KV
caches) and never counted as kept, and the size is fitted to the device and the model's
context when `cache.ram_gb` is unset."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry

from pipeserve.memory import MemoryModel
from pipeserve.metrics import Metrics
from pipeserve.prompt_cache import ram as ram_module
from pipeserve.prompt_cache.ram import FLOOR_BYTES, RamPromptCache, fit_ram_bytes
from tests.conftest import make_config

LAYERS, TOKENS = 4, 256
LAYER_BYTES = 2 * 2 * TOKENS * 64 * 4   # keys + values, (1, 2, 256, 64) float32 each
ENTRY = LAYERS * LAYER_BYTES            # 512 KiB


def caches(seed: int) -> list[KVCache]:
    out = []
    for i in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, 2, TOKENS, 64), key=mx.random.key(seed * 100 + i))
        c.update_and_fetch(k, k + 1)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def tokens(seed: int) -> list[int]:
    return [3 + seed] + [5 + (seed * 31 + j) % 400 for j in range(TOKENS - 1)]


def tier() -> tuple[RamPromptCache, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return RamPromptCache(make_config("cache=ram"), metrics, max_bytes=ENTRY // 2), metrics


def test_an_entry_larger_than_the_tier_is_never_copied(monkeypatch) -> None:
    cache, metrics = tier()
    calls: list[int] = []
    real = ram_module.mx.async_eval
    monkeypatch.setattr(ram_module.mx, "async_eval",
                        lambda arrays: (calls.append(len(arrays)), real(arrays))[1])
    assert cache.put(tokens(1), caches(1)) is None
    assert calls == [] and not cache.entries
    assert metrics.cache_too_large.labels("ram")._value.get() == 1
    assert cache.kept([ENTRY]) == 0 and cache.kept([ENTRY // 4]) == 1
    cache.on_evict = lambda entry: None   # an SSD tier behind it: still never this one
    assert cache.kept([ENTRY // 4, ENTRY, ENTRY // 4]) == 2


def memory(kv_per_token: int, context: int, device_gb: float, weights_gb: float) -> MemoryModel:
    return MemoryModel(weight_bytes=int(weights_gb * 1e9), kv_bytes_per_token=kv_per_token,
                       window_tokens=None, windowed_bytes_per_token=0, state_bytes_per_row=0,
                       prefill_temp_bytes=0, device_bytes=int(device_gb * 1e9),
                       max_context=context, enforced=False)


@pytest.mark.parametrize("device_gb, context, want", [
    (113.0, 65_700, 2 * 147_456 * 65_700),     # H200, 8B, 64k: two whole contexts (19.4 GB)
    (113.0, 262_144, int((113.0 - 14.2) * 1e9) // 4),   # 256k: a quarter of what is left
    (10.7, 40_960, FLOOR_BYTES),               # a 16 GB Mac: never below the fixed 8 GiB
    (113.0, 4_096, FLOOR_BYTES),               # a short context: the floor
])
def test_the_ram_tier_is_fitted_when_unset(device_gb: float, context: int, want: int) -> None:
    got, why = fit_ram_bytes(None, memory(147_456, context, device_gb, 14.2))
    assert got == want and why.startswith("fitted")
    assert fit_ram_bytes(2.0, memory(147_456, context, device_gb, 14.2)) == (2 << 30,
                                                                              "cache.ram_gb")
