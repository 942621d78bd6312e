"""Rows joining a batch: pipeserve's one-concatenation merge of plain KV caches gives exactly
mlx-lm's BatchKVCache.merge (the same keys, values, padding and positions). Pure MLX."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from pipeserve.core.rows import merge_layer


def row(n: int, seed: int, capacity_step: int = 256) -> KVCache:
    c = KVCache()
    c.step = capacity_step
    k = mx.random.normal((1, 4, n, 16), key=mx.random.key(seed)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 2)
    return c


@pytest.mark.parametrize("lengths", [[7, 7, 7], [3, 9, 5, 9], [1, 12], [256, 300]])
def test_the_concatenated_merge_equals_mlx_lms(lengths: list[int]) -> None:
    layers = [row(n, i) for i, n in enumerate(lengths)]
    ours, theirs = merge_layer(layers), BatchKVCache.merge(layers)
    assert type(ours) is BatchKVCache
    assert ours.keys.shape == theirs.keys.shape
    assert mx.array_equal(ours.keys, theirs.keys) and mx.array_equal(ours.values, theirs.values)
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist() and ours._idx == theirs._idx
    # and it decodes on like theirs: one more token for every row
    k = mx.ones((len(lengths), 4, 1, 16), mx.bfloat16)
    a, b = ours.update_and_fetch(k, k), theirs.update_and_fetch(k, k)
    assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
