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


def _store_of(lengths: dict[str, int], heads: int = 4, dim: int = 16) -> RowStore:
    """A decode batch of these rows (two plain layers), each row's KV seeded by its length."""
    store = RowStore(lambda: [KVCache(), KVCache()])
    for rid, n in lengths.items():
        k = mx.random.normal((1, heads, n, dim), key=mx.random.key(n)).astype(mx.bfloat16)
        for layer in store.own(rid):
            layer.update_and_fetch(k, k * 2)
    store.decode_batch(list(lengths), {rid: i for i, rid in enumerate(lengths)})
    return store


def _kv(store: RowStore, rid: str) -> list[tuple[int, mx.array, mx.array]]:
    out = []
    for c in store.caches_of(rid):
        n = c.offset if isinstance(c.offset, int) else int(c.offset.item())
        out.append((n, c.keys[..., :n, :], c.values[..., :n, :]))
    mx.eval(out)
    return out


def _same(a: list, b: list) -> bool:
    return all(n == m and mx.array_equal(k, k2) and mx.array_equal(v, v2)
               for (n, k, v), (m, k2, v2) in zip(a, b))


def test_a_whole_batch_parked_at_once_keeps_its_kv_without_copying_it() -> None:
    """Every row leaving the decode batch at once (a burst whose last outputs are in flight
    while new prompts prefill) parks as it is: no row is copied — on an 80 GB GPU those copies
    beside the old batch ran a 128-row burst out of memory — and each row's KV is unchanged,
    to rejoin or be stored from."""
    lengths = {"a": 3000, "b": 2900, "c": 3100, "d": 3000}
    store = _store_of(lengths, heads=8, dim=64)
    before = {rid: _kv(store, rid) for rid in lengths}
    batch_bytes = store.nbytes
    k = mx.ones((1, 8, 20, 64), mx.bfloat16)
    for layer in store.own("e"):   # a new row, its prompt done, decodes next
        layer.update_and_fetch(k, k)
    mx.synchronize()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    store.decode_batch(["e"], {"e": 0})
    mx.synchronize()
    assert mx.get_peak_memory() - start < batch_bytes // 8   # not another batch's worth
    assert store.decode_rows == ["e"] and store.num_rows == 5
    assert all(_same(_kv(store, rid), before[rid]) for rid in lengths)
    # they rejoin together, later, and decode on with the KV they had
    store.decode_batch(["c", "a"], {"c": 1, "a": 2})
    assert sorted(store.decode_rows) == ["a", "c"]
    assert _same(_kv(store, "a"), before["a"]) and _same(_kv(store, "c"), before["c"])
    assert _same(_kv(store, "b"), before["b"]) and _same(_kv(store, "d"), before["d"])
    store.release_many(["a", "b", "c", "d", "e"])
    assert store.num_rows == 0 and store.nbytes == 0


@pytest.mark.parametrize("keep", [["b"], ["a", "b", "d"], ["d", "a"]])
def test_rows_parked_while_others_decode_on_keep_their_kv(keep: list[str]) -> None:
    """Some rows leave, the rest decode on: the staying rows' next writes never reach the
    parked rows' KV (whether the parked rows kept the old batch or were gathered out of it),
    a parked row fed on its own (a drafter catching up) gets its KV as its own caches, and
    every row's KV ends as a plain path keeps it."""
    lengths = {"a": 9, "b": 17, "c": 5, "d": 12}
    store = _store_of(lengths)
    before = {rid: _kv(store, rid) for rid in lengths}
    caches, order, _ = store.decode_batch(keep, {})
    assert order == [r for r in lengths if r in keep]
    k = mx.full((len(order), 4, 1, 16), 7.0, mx.bfloat16)
    for layer in caches:   # the staying rows decode one token
        layer.update_and_fetch(k, k)
    parked = [r for r in lengths if r not in keep]
    assert all(_same(_kv(store, r), before[r]) for r in parked)
    for r in keep:
        (n, key, _), = _kv(store, r)[:1]
        assert n == lengths[r] + 1 and mx.array_equal(key[..., :-1, :], before[r][0][1])
        assert bool(mx.all(key[..., -1:, :] == 7.0))
    own = store.own(parked[0])   # fed on its own from here
    assert [c.offset for c in own] == [lengths[parked[0]]] * 2
    assert _same(_kv(store, parked[0]), before[parked[0]])
    assert all(_same(_kv(store, r), before[r]) for r in parked[1:])
    store.decode_batch(list(lengths), {r: 0 for r in lengths})   # everyone back
    assert all(_same(_kv(store, r)[:1], before[r][:1]) or r in keep for r in lengths)
    store.release_many(list(lengths))
    assert store.num_rows == 0 and store.nbytes == 0
