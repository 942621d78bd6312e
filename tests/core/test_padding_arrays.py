"""A prefill group's layers take their per-row padding arrays from one array made once
(rows.padding_array): the caches must be mlx-lm's own, attribute for attribute, and one
layer's in-place update (mlx-lm's `offset += n`) must never reach another layer."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from pipeserve.core.rows import batch_kv, merge_layer, pad_left, pad_right


def same(a: BatchKVCache, b: BatchKVCache) -> None:
    mine = {k: v for k, v in vars(a).items() if not k.startswith("_host_")}   # pipeserve's notes
    assert sorted(mine) == sorted(vars(b))
    for name, x in mine.items():
        y = getattr(b, name)
        if isinstance(x, mx.array):
            assert mx.array_equal(x, y), name
        else:
            assert x == y or (x is None and y is None), name


def test_batch_kv_is_mlx_lms_constructor() -> None:
    same(batch_kv([3, 0, 1], {}), BatchKVCache([3, 0, 1]))
    same(batch_kv([2, 2]), BatchKVCache([2, 2]))


def test_layers_sharing_a_padding_never_share_an_update() -> None:
    made: dict = {}
    one, two = batch_kv([1, 0], made), batch_kv([1, 0], made)
    one.offset += 5   # what mlx-lm's update_and_fetch does to its own layer
    one.left_padding += 1
    assert one.offset.tolist() == [4, 5] and two.offset.tolist() == [-1, 0]
    assert two.left_padding.tolist() == [1, 0]
    assert len(made) == 2   # two arrays made, for any number of layers


def test_merges_and_padding_match_mlx_lms() -> None:
    def row(n: int) -> KVCache:
        c = KVCache()
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(n))
        c.update_and_fetch(k, k + 1)
        return c
    made: dict = {}
    empty = merge_layer([KVCache(), KVCache(), KVCache()], room=4, made=made)
    want = BatchKVCache.merge([KVCache(), KVCache(), KVCache()])
    same(empty, want)
    pad_left([empty], [2, 0, 1], made)
    want.prepare(left_padding=[2, 0, 1])
    same(empty, want)
    hit = merge_layer([row(5), row(3)], room=4, made=made)
    mine = BatchKVCache.merge([row(5), row(3)])
    assert hit.offset.tolist() == mine.offset.tolist() == [5, 3]
    assert hit.left_padding.tolist() == mine.left_padding.tolist() == [0, 2]
    assert mx.array_equal(hit.keys[..., :5, :], mine.keys)
    pad_right([hit], [4, 2], [0, 2], made)
    mine.prepare(lengths=[4, 2], right_padding=[0, 2])
    assert hit._right_padding.tolist() == mine._right_padding.tolist() == [0, 2]
