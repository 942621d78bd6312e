"""Rows joining and leaving a batch: pipeserve's one-concatenation merge of plain KV caches
gives exactly mlx-lm's BatchKVCache.merge (the same keys, values, padding and positions), and
its extract and filter, which read the rows' padding once for every layer, exactly mlx-lm's.
Pure MLX."""
from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from pipeserve.core.rows import RowStore, extract_rows, filter_layers, merge_layer
from pipeserve.kv.quantized import AffineKVCache, BatchAffineKVCache
from pipeserve.kv.turbo import BatchTurboKVCache, TurboKVCache


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


def batch(lengths: list[int]) -> BatchKVCache:
    """A decode batch as the engine's would be after a few steps: merged rows, then tokens."""
    b = merge_layer([row(n, i) for i, n in enumerate(lengths)])
    for t in range(3):
        k = mx.full((len(lengths), 4, 1, 16), float(t), mx.bfloat16)
        b.update_and_fetch(k, k)
    return b


def clone(b: BatchKVCache) -> BatchKVCache:
    c = BatchKVCache([0] * b.keys.shape[0])
    c.keys, c.values, c.offset, c.left_padding, c._idx = (
        b.keys, b.values, b.offset, b.left_padding, b._idx)
    return c


@pytest.mark.parametrize("keep", [[0, 2], [1, 3], [3], [2, 0, 1]])
def test_rows_leave_a_batch_as_mlx_lms_filter_and_extract_leave_them(keep: list[int]) -> None:
    """The row store reads every layer's padding once (not once a layer and row); what rows
    leave with and what the batch keeps equal mlx-lm's extract and filter, value for value."""
    lengths = [5, 12, 3, 9]
    layers = [batch(lengths), batch(lengths)]
    leaving = [i for i in range(len(lengths)) if i not in keep]
    out = extract_rows(layers, leaving)
    for j, i in enumerate(leaving):
        for layer, mine in zip(layers, out[j]):
            theirs = layer.extract(i)
            assert mine.offset == theirs.offset == lengths[i] + 3
            assert mx.array_equal(mine.keys, theirs.keys)
            assert mx.array_equal(mine.values, theirs.values)
    prefix = extract_rows(layers, leaving, upto=2)
    assert all(c.offset == 2 and mx.array_equal(c.keys, layers[0].extract(i).keys[..., :2, :])
               for c, i in zip((p[0] for p in prefix), leaving))

    theirs = [clone(layer) for layer in layers]
    idx = mx.array(keep, dtype=mx.int32)
    for layer in theirs:
        layer.filter(idx)
    filter_layers(layers, keep, idx)
    for mine, ref in zip(layers, theirs):
        assert mine._idx == ref._idx and mine.keys.shape == ref.keys.shape
        assert mx.array_equal(mine.keys, ref.keys) and mx.array_equal(mine.values, ref.values)
        assert mine.left_padding.tolist() == ref.left_padding.tolist()
        assert mine.offset.tolist() == ref.offset.tolist()


def test_a_batched_rows_prefix_copy_is_what_its_caches_hold() -> None:
    """copy_of: a batched row's first positions, copied once at their exact size (what a
    prompt-cache entry keeps as it is); a row with caches of its own gets None (the caller
    copies from caches_of)."""
    store = RowStore(lambda: [KVCache()])
    for rid, n in (("a", 7), ("b", 19)):
        r = row(n, n)
        store.own(rid)[0].update_and_fetch(r.keys[..., :n, :], r.values[..., :n, :])
    store.decode_batch(["a", "b"], {"a": 1, "b": 2})
    assert store.decode_rows == ["a", "b"] and store.caches_of("a")[0].offset == 7
    for rid, n in (("a", 7), ("b", 19)):
        held = store.caches_of(rid)[0]
        fresh = store.copy_of(rid, n - 2)[0]
        assert fresh.offset == n - 2 and fresh.keys.shape[2] == n - 2
        assert mx.array_equal(fresh.keys, held.keys[..., :n - 2, :])
        assert mx.array_equal(fresh.values, held.values[..., :n - 2, :])
    assert store.copy_of("a", 7 + 1) is None   # more than the row holds (its input is fed next)
    store.own("c")
    assert store.copy_of("c", 1) is None


def test_rows_leaving_one_batch_together_are_copied_with_one_padding_read(monkeypatch) -> None:
    """copies_of: each row's copy equals its own copy_of, and the rows of one batch cost one
    read of its padding (a read waits for the device and gives the GIL up), not one a row."""
    from pipeserve.core import rows as rows_module
    store = RowStore(lambda: [KVCache(), KVCache()])
    sizes = {"a": 7, "b": 19, "c": 12}
    for rid, n in sizes.items():
        r = row(n, n)
        for layer in store.own(rid):
            layer.update_and_fetch(r.keys[..., :n, :], r.values[..., :n, :])
    store.decode_batch(list(sizes), {rid: i for i, rid in enumerate(sizes)})
    wanted = {"a": 5, "b": 19, "c": 13}   # c holds 12: none for it, as copy_of says
    one_by_one = {rid: store.copy_of(rid, n) for rid, n in wanted.items()}
    reads = []
    real = rows_module.host_padding
    monkeypatch.setattr(rows_module, "host_padding", lambda c: reads.append(1) or real(c))
    together = store.copies_of(wanted)
    assert len(reads) == 1
    assert set(together) == {"a", "b"} and one_by_one["c"] is None
    for rid, copy in together.items():
        for mine, theirs in zip(copy, one_by_one[rid]):
            assert mine.offset == theirs.offset == wanted[rid]
            assert mx.array_equal(mine.keys, theirs.keys)
            assert mx.array_equal(mine.values, theirs.values)


@pytest.mark.parametrize("layout", ["q8", "turbo"])
def test_quantized_rows_leave_a_batch_as_their_own_extract_and_filter_leave_them(layout: str
                                                                                  ) -> None:
    """The quantized layouts are told the padding the store read once; what they give is what
    their own extract and filter give reading it themselves."""
    one, batched = {"q8": (AffineKVCache, BatchAffineKVCache),
                    "turbo": (TurboKVCache, BatchTurboKVCache)}[layout]
    lengths = [70, 130, 64]

    def layer() -> Any:
        rows = []
        for i, n in enumerate(lengths):
            c = one()
            k = mx.random.normal((1, 2, n, 64), key=mx.random.key(i))
            c.update_and_fetch(k, k * 2)
            rows.append(c)
        b = batched.merge(rows)
        k = mx.ones((len(lengths), 2, 1, 64))
        b.update_and_fetch(k, k)
        return b

    def same(a: Any, b: Any) -> bool:
        return (a.offset == b.offset if isinstance(a.offset, int)
                else a.offset.tolist() == b.offset.tolist()) and all(
            mx.array_equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))

    layers = [layer(), layer()]
    for i, mine in zip([0, 2], extract_rows([layers[0]], [0, 2])):
        assert same(mine[0], layers[0].extract(i))
    theirs = [copy.copy(c) for c in layers]
    idx = mx.array([1, 2], dtype=mx.int32)
    for c in theirs:
        c.filter(idx)
    filter_layers(layers, [1, 2], idx)
    for mine, ref in zip(layers, theirs):
        assert mine._idx == ref._idx and same(mine, ref)
        assert mine.left_padding.tolist() == ref.left_padding.tolist()
