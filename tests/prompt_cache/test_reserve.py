"""reserve: a prompt-cache hit's KV gets room up to the row's next chunk boundary, so the row's
buffers grow through the sizes a cold row's do (no allocation sizes new to MLX's allocator for
each hit length), holding the same keys and values."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeserve.prompt_cache.protocol import reserve, shrink


def filled(n: int) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 2, n, 4))
    c.update_and_fetch(k, k + 1)
    return c


def test_a_hit_grows_like_a_cold_row() -> None:
    chunk = 512
    hit = shrink(filled(16))   # exactly the 16 reused tokens, as a cache hit hands them
    room = reserve([hit], chunk)[0]
    assert room.keys.shape[2] == chunk and room.offset == 16
    assert mx.array_equal(room.keys[..., :16, :], hit.keys[..., :16, :])
    assert mx.array_equal(room.values[..., :16, :], hit.values[..., :16, :])
    cold, plain = KVCache(), shrink(filled(16))
    plain.keys, plain.values = hit.keys, hit.values
    for c, first in ((cold, chunk), (room, chunk - 16), (plain, chunk - 16)):
        x = mx.zeros((1, 2, first, 4))
        c.update_and_fetch(x, x)   # the chunk that ends on the boundary
        y = mx.zeros((1, 2, chunk, 4))
        c.update_and_fetch(y, y)   # the next full chunk
    assert room.keys.shape[2] == cold.keys.shape[2] == 2 * chunk
    assert plain.keys.shape[2] == 2 * chunk + 16   # what an exact-size prefix grows to


def test_other_layouts_and_full_caches_pass_through() -> None:
    full = filled(600)
    assert reserve([full], 512)[0] is full
    assert reserve([None], 512) == [None]
