"""A finished row's KV becomes its prompt-cache entry without a copy (counted with MLX's own
memory counters): the row is freed right after, so its buffers are handed over, not copied
and then freed. The entry still holds exactly its tokens, stays intact when a hit on it
writes, and counts the bytes it keeps alive; a short row (mostly preallocated room) and a
row that only holds a hit's lent views are copied, as before."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry

from pipeserve.core.rows import RowStore
from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.ram import RamPromptCache
from tests.conftest import make_config


def row(n: int, seed: int = 0) -> KVCache:
    """A row's cache as its forwards leave it: `n` tokens in a buffer grown by 256s."""
    c = KVCache()
    k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed))
    c.update_and_fetch(k, k + 1)
    mx.eval(c.keys, c.values)
    return c


def put(cache: RamPromptCache, tokens: list[int], caches: list[KVCache], handed: bool
        ) -> tuple[int, int]:
    """(bytes the put allocated, the entry's counted bytes)."""
    mx.synchronize()
    before = mx.get_active_memory()
    entry = cache.put(tokens, caches, handed=handed)
    mx.eval([c.keys for c in entry.caches] + [c.values for c in entry.caches])
    mx.synchronize()
    return mx.get_active_memory() - before, entry.nbytes


def test_a_finished_rows_buffers_become_its_entry_without_a_copy() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    n = 2000
    tokens = [3 + i % 200 for i in range(n)]
    finished = row(n)
    kv_bytes = 2 * finished.keys[..., :n, :].nbytes
    expect = mx.array(finished.keys[..., :n, :])

    allocated, counted = put(cache, tokens, [finished], handed=True)
    assert allocated < kv_bytes // 100                                  # no copy
    assert counted == finished.keys.nbytes + finished.values.nbytes    # the buffers it keeps

    copied = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    allocated, counted = put(copied, tokens, [row(n)], handed=False)
    assert allocated >= kv_bytes and counted == kv_bytes               # the copy it replaces

    step = mx.full((1, 2, 1, 64), 9.0)
    finished.update_and_fetch(step, step)   # a write into the handed buffers' room
    hit = cache.lookup(tokens + [7])        # an exact repeat: its row writes its next token
    assert hit.num_tokens == n
    lent = hit.caches[0]
    lent.update_and_fetch(step, step)
    mx.eval(finished.keys, lent.keys)
    again = cache.lookup(tokens + [7]).caches[0]
    assert again.offset == n and mx.array_equal(again.keys[..., :n, :], expect)


def test_short_rows_and_unwritten_hits_are_copied() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    short = row(40, seed=1)   # 40 tokens in a 256-token buffer
    allocated, counted = put(cache, list(range(3, 43)), [short], handed=True)
    assert counted == 2 * short.keys[..., :40, :].nbytes and allocated >= counted

    store = RowStore(lambda: [KVCache()])
    store.adopt("hit", [row(300, seed=2)])
    assert not store.sole("hit")      # a hit's lent views: the lender's buffers
    store.own("hit")                  # its prefill chunk writes its own
    assert store.sole("hit")
    store.decode_batch(["hit"], {"hit": 5})
    assert store.sole("hit")          # the lone decode row's caches are its own
    other = store.own("other")
    x = mx.zeros((1, 2, 20, 64))
    other[0].update_and_fetch(x, x)
    store.decode_batch(["hit", "other"], {"other": 6})
    assert not store.sole("hit") and not store.sole("other")   # a batched row's: extracted
