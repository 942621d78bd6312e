"""lend_prefix: what a prompt-cache hit borrows of an entry (take). A plain KVCache is lent as
two views made at once; every layout must hold what lend → trim → shrink gives, and a write to
the lent cache must never reach the entry."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeserve.kv.quantized import AffineKVCache
from pipeserve.prompt_cache.protocol import lend, lend_prefix, shrink


def filled(cache, n: int):
    k = mx.random.normal((1, 2, n, 64), key=mx.random.key(n))
    cache.update_and_fetch(k, k * 2)
    return shrink(cache)   # an entry holds exactly its content


def generic(layer, n: int, total: int):
    c = lend(layer)
    if n < total:
        c.trim(total - n)
        c = shrink(c)
    return c


def arrays(state) -> list[mx.array]:
    out = []
    for a in state if isinstance(state, (list, tuple)) else [state]:
        out += arrays(a) if isinstance(a, (list, tuple)) else [a] if isinstance(a, mx.array) else []
    return out


def test_a_plain_prefix_is_the_generic_one_and_never_writes_the_entry() -> None:
    entry = filled(KVCache(), 40)
    before = mx.array(entry.keys)
    for n in (40, 25, 1):
        got, want = lend_prefix(entry, n, 40), generic(entry, n, 40)
        assert type(got) is KVCache and got.offset == want.offset == n
        assert got.keys.shape == want.keys.shape == (1, 2, n, 64)
        assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)
        x = mx.ones((1, 2, 3, 64))
        got.update_and_fetch(x, x)   # the hit's next chunk
        assert got.offset == n + 3 and mx.array_equal(got.keys[..., n:n + 3, :], x)
    assert entry.offset == 40 and mx.array_equal(entry.keys, before)


def test_other_layouts_take_the_generic_path() -> None:
    entry = filled(AffineKVCache(8, 8, 64), 40)
    got, want = lend_prefix(entry, 25, 40), generic(entry, 25, 40)
    assert type(got) is AffineKVCache and got.offset == want.offset == 25
    for a, b in zip(arrays(got.state), arrays(want.state), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b)
    assert entry.offset == 40
