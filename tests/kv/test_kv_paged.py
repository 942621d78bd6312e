"""kv=paged on real tiny float32 models: paged KV gives exactly the dense results (per row and
in a batch whose rows join and leave), rows lent from one prefix share its blocks and copy
only on divergence, nothing leaks, exhaustion is a clear typed error that changes nothing, and
the portable form (the SSD tier's) continues identically."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pipeserve  # noqa: F401  (loads OpenBLAS first)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache

from pipeserve.kv.paged import (BatchPagedKVCache, BlockPool, PagedKVCache, PoolExhausted,
                               make_pools, paged_cache)
from pipeserve.prompt_cache import codec
from pipeserve.prompt_cache.ram import lend as ram_lend
from pipeserve.model.tiny.text import ensure_model

BLOCK = 16
STEPS = 24


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 500 for i in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("paged-models")
    return {arch: load(str(ensure_model(arch, "tiny", "float32", root)))[0]
            for arch in ("qwen3", "gemma3")}


def assert_no_leak(pools: dict[int, BlockPool]) -> None:
    gc.collect()
    for pool in pools.values():
        assert (pool.num_free, pool.num_shared) == (pool.num_blocks, 0)


def feed(model: Any, ids: list[int] | mx.array, cache: list[Any]) -> mx.array:
    x = mx.array([ids]) if isinstance(ids, list) else ids
    logits = model(x, cache=cache)[:, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits


def greedy(model: Any, logits: mx.array, cache: list[Any], n: int = STEPS) -> tuple[list[int], mx.array]:
    out, seen = [], [logits]
    for _ in range(n):
        y = mx.argmax(logits, axis=-1)
        out.append(y.item())
        logits = feed(model, y[:, None], cache)
        seen.append(logits)
    return out, mx.concatenate(seen)


def merge(rows: list[list[Any]]) -> list[Any]:
    return [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]


def run_batch(model: Any, make: Any, grouped: bool) -> tuple[dict[str, list[int]], list[mx.array], list[int]]:
    """Rows a, b, c start together (prefilled alone then merged, or in one right-padded
    forward), d joins at step 6 (extend), b leaves at step 12 (filter), and at step 18 only c
    is left and continues alone (extract), as pipeserve.core.rows.RowStore does. Returns each
    row's tokens, every step's logits and each layer's nbytes after the prompts."""
    prompts = {"a": prompt(70, 1), "b": prompt(41, 2), "c": prompt(23, 3), "d": prompt(55, 4)}
    names = ["a", "b", "c"]
    if grouped:
        heads = [prompts[k][:-1] for k in names]
        width = max(map(len, heads))
        cache = merge([make() for _ in names])
        for layer in cache:
            layer.prepare(lengths=[len(h) for h in heads], right_padding=[width - len(h) for h in heads])
        model(mx.array([h + [0] * (width - len(h)) for h in heads]), cache=cache)
        for layer in cache:
            layer.finalize()
    else:
        rows = [make() for _ in names]
        for k, row in zip(names, rows):
            feed(model, prompts[k][:-1], row)
        cache = merge(rows)
    held = [layer.nbytes for layer in cache]
    tokens = mx.array([[prompts[k][-1]] for k in names])
    out: dict[str, list[int]] = {k: [] for k in prompts}
    seen = []
    for step in range(STEPS):
        if step == 6:
            joiner = make()
            feed(model, prompts["d"][:-1], joiner)
            for mine, theirs in zip(cache, merge([joiner])):
                mine.extend(theirs)
            names.append("d")
            tokens = mx.concatenate([tokens, mx.array([[prompts["d"][-1]]])])
        if step in (12, 18):
            leaving = {"b"} if step == 12 else {"a", "d"}
            keep = [i for i, k in enumerate(names) if k not in leaving]
            for layer in cache:
                layer.filter(mx.array(keep))
            names = [names[i] for i in keep]
            tokens = tokens[mx.array(keep)]
            if len(names) == 1:
                cache = [layer.extract(0) for layer in cache]
        logits = feed(model, tokens, cache)
        seen.append(logits)
        y = mx.argmax(logits, axis=-1)
        for k, t in zip(names, y.tolist()):
            out[k].append(t)
        tokens = y[:, None]
    return out, seen, held


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_paged_equals_dense_per_row(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    ids = prompt(70, 0)   # 5 blocks of 16
    dense = make_prompt_cache(model)
    want, want_logits = greedy(model, feed(model, ids, dense), dense)
    pools = make_pools(model, BLOCK, 64)
    paged = paged_cache(model, pools)
    got, got_logits = greedy(model, feed(model, ids, paged), paged)
    assert got == want
    assert mx.array_equal(got_logits, want_logits).item()
    pairs = [(d, p) for d, p in zip(dense, paged) if isinstance(p, PagedKVCache)]
    assert len(pairs) == (2 if arch == "qwen3" else 1)   # gemma3's sliding layer stays mlx-lm's
    for d, p in pairs:
        assert np.array_equal(np.array(p.portable().keys), np.array(d.keys[..., :d.offset, :]))
        assert np.array_equal(np.array(p.portable().values), np.array(d.values[..., :d.offset, :]))
        assert p.size() == d.size() == 70 + STEPS
        assert p.nbytes == 6 * p.pool.block_nbytes   # 94 tokens in blocks of 16
    del paged, pairs, d, p   # the loop names hold references too
    assert_no_leak(pools)


@pytest.mark.parametrize("grouped", [False, True], ids=["merge", "right-padded"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_paged_batch_equals_dense_batch(models: dict[str, Any], arch: str, grouped: bool) -> None:
    model = models[arch]
    want, want_logits, _ = run_batch(model, lambda: make_prompt_cache(model), grouped)
    pools = make_pools(model, BLOCK, 64)
    got, got_logits, held = run_batch(model, lambda: paged_cache(model, pools), grouped)
    assert got == want
    # prompts of 69, 40 and 22 tokens hold 5 + 3 + 2 blocks: no padding is stored
    assert [held[i] for i in pools] == [10 * p.block_nbytes for p in pools.values()]
    assert all(len(v) for v in got.values())
    assert all(mx.array_equal(g, w).item() for g, w in zip(got_logits, want_logits))
    assert_no_leak(pools)


def test_lent_prefix_is_shared_and_copied_once_on_divergence(models: dict[str, Any]) -> None:
    model = models["qwen3"]
    prefix, tail_a, tail_b = prompt(40, 5), [11, 12, 13], [21, 22, 23]   # 40 = 2.5 blocks
    cold = {}
    for name, tail in (("a", tail_a), ("b", tail_b)):
        c = make_prompt_cache(model)
        cold[name] = greedy(model, feed(model, prefix + tail, c), c)[0]
    assert cold["a"] != cold["b"]

    pools = make_pools(model, BLOCK, 32)
    donor = paged_cache(model, pools)
    feed(model, prefix, donor)
    row_a = [c.lend() for c in donor]
    row_b = [ram_lend(c) for c in donor]     # the prompt cache's generic lend shares too
    del donor
    gc.collect()
    for i, pool in pools.items():
        assert pool.num_used == 3 and pool.num_shared == 3
        assert row_a[i].table.ids == row_b[i].table.ids
        assert all(pool.refcount(b) == 2 for b in row_a[i].table.ids)

    first_a = feed(model, tail_a, row_a)    # writes into the shared, partly filled 3rd block
    for i, pool in pools.items():
        assert pool.num_used == 4 and pool.num_shared == 2   # one copy; 2 full blocks shared
        assert row_a[i].table.ids[:2] == row_b[i].table.ids[:2]
        assert row_a[i].table.ids[2] != row_b[i].table.ids[2]
    first_b = feed(model, tail_b, row_b)    # now the sole owner: writes in place
    assert all(pool.num_used == 4 for pool in pools.values())
    assert greedy(model, first_a, row_a)[0] == cold["a"]
    assert greedy(model, first_b, row_b)[0] == cold["b"]
    del row_a, row_b, first_a, first_b
    assert_no_leak(pools)


def test_batched_rows_from_one_prefix_copy_the_shared_block_once(models: dict[str, Any]) -> None:
    """Two lent rows write into the same shared block in one batched step: one copy, which
    fits a pool with exactly one free block (no spurious exhaustion)."""
    model = models["qwen3"]
    prefix = prompt(40, 6)
    cold = []
    for t in (7, 9):
        c = make_prompt_cache(model)
        cold.append(greedy(model, feed(model, prefix + [t], c), c, 8)[0])
    pools = make_pools(model, BLOCK, 4)
    donor = paged_cache(model, pools)
    feed(model, prefix, donor)
    batch = merge([[c.lend() for c in donor], [c.lend() for c in donor]])
    del donor
    gc.collect()
    assert all(p.num_free == 1 and p.num_shared == 3 for p in pools.values())
    logits = feed(model, mx.array([[7], [9]]), batch)
    assert all(p.num_free == 0 and p.num_shared == 2 for p in pools.values())
    out: list[list[int]] = [[], []]
    for _ in range(7):   # up to 48 tokens: still inside the third blocks
        y = mx.argmax(logits, axis=-1)
        for row, t in zip(out, y.tolist()):
            row.append(t)
        logits = feed(model, y[:, None], batch)
    for row, t in zip(out, mx.argmax(logits, axis=-1).tolist()):
        row.append(t)
    assert out == cold
    del batch
    assert_no_leak(pools)


def test_exhaustion_is_typed_clear_and_changes_nothing(models: dict[str, Any]) -> None:
    model = models["qwen3"]
    pools = make_pools(model, BLOCK, 4)   # 64 tokens per row at most
    cache = paged_cache(model, pools)
    with pytest.raises(PoolExhausted) as err:
        feed(model, prompt(70, 7), cache)
    assert "needs 5 blocks of 16 tokens but only 4 of 4 are free" in str(err.value)
    assert "kv.pool_blocks" in str(err.value)
    assert (err.value.status, err.value.error_type) == (503, "kv_pool_exhausted")
    assert all(p.num_free == 4 for p in pools.values()) and all(c.offset == 0 for c in cache)
    del err   # its traceback's frames hold the caches

    ref = make_prompt_cache(model)               # the same operations on dense KV
    got, seen = greedy(model, feed(model, prompt(50, 7), cache), cache, 14)   # 64 slots full
    assert greedy(model, feed(model, prompt(50, 7), ref), ref, 14)[0] == got
    assert all(c.offset == 64 and p.num_free == 0 for c, p in zip(cache, pools.values()))
    y = mx.argmax(seen[-1:], axis=-1)[:, None]
    with pytest.raises(PoolExhausted, match="needs 1 blocks of 16 tokens but only 0 of 4"):
        feed(model, y, cache)
    assert all(c.offset == 64 for c in cache)    # no layer took the token
    assert all(c.trim(20) == 20 and r.trim(20) == 20 for c, r in zip(cache, ref))
    assert all(p.num_free == 1 for p in pools.values())   # 44 tokens left: 3 blocks
    assert mx.array_equal(feed(model, y, cache), feed(model, y, ref)).item()

    # a batched step is all rows or none
    a, b = paged_cache(model, pools), paged_cache(model, pools)
    del cache
    gc.collect()
    feed(model, prompt(32, 8), a)
    feed(model, prompt(32, 9), b)
    batch = merge([a, b])
    del a, b
    assert all(p.num_free == 0 for p in pools.values())
    with pytest.raises(PoolExhausted, match="needs 2 blocks"):
        feed(model, mx.array([[1], [2]]), batch)
    assert all(layer.size() == 32 and layer.nbytes == 4 * pools[0].block_nbytes for layer in batch)
    del batch
    assert_no_leak(pools)


def test_portable_round_trip_continues_identically(models: dict[str, Any]) -> None:
    model = models["qwen3"]
    pools = make_pools(model, BLOCK, 32)
    ids = prompt(45, 10)
    paged = paged_cache(model, pools)
    first = feed(model, ids, paged)
    portable = [c.portable() for c in paged]
    assert all(type(c) is KVCache and c.offset == 45 for c in portable)
    # the SSD codec stores portable() copies of paged caches: same bytes as the dense copy
    assert codec.encode(ids, paged) == codec.encode(ids, portable)
    tokens, stored = codec.decode(codec.encode(ids, paged), verify=True)
    restored = [PagedKVCache.from_portable(c, pools[i]) for i, c in enumerate(stored)]
    want, want_logits = greedy(model, first, paged)
    from_disk, disk_logits = greedy(model, first, restored)
    dense, dense_logits = greedy(model, first, portable)
    assert tokens == ids
    assert want == from_disk == dense
    assert mx.array_equal(want_logits, disk_logits).item()
    assert mx.array_equal(want_logits, dense_logits).item()
    del paged, restored
    assert_no_leak(pools)


def test_batch_extract_and_filter_share_blocks_without_copies(models: dict[str, Any]) -> None:
    model = models["qwen3"]
    pools = make_pools(model, BLOCK, 32)
    rows = [paged_cache(model, pools) for _ in range(3)]
    for n, row in zip((20, 33, 7), rows):
        feed(model, prompt(n, n), row)
    used = pools[0].num_used
    batch = merge(rows)
    assert isinstance(batch[0], BatchPagedKVCache)
    assert batch[0].left_padding.tolist() == [13, 0, 26] and batch[0].offset.tolist() == [20, 33, 7]
    assert pools[0].num_used == used and pools[0].num_shared == used   # every block shared
    del rows, row
    gc.collect()
    assert pools[0].num_shared == 0
    for layer in batch:
        layer.filter(mx.array([0, 2]))
    assert batch[0].size() == 20 and batch[0].left_padding.tolist() == [0, 13]
    solo = [layer.extract(1) for layer in batch]
    assert solo[0].offset == 7 and pools[0].num_shared == 1
    del batch, layer
    gc.collect()
    assert pools[0].num_used == 1 and pools[0].num_shared == 0
    del solo
    assert_no_leak(pools)


def random_kv(rng: np.random.Generator, rows: int, n: int) -> tuple[mx.array, mx.array]:
    return tuple(mx.array(rng.standard_normal((rows, 2, n, 8)).astype(np.float32)) for _ in "kv")


def test_batched_fetch_is_exactly_batch_kv_cache_layout() -> None:
    """The arrays the attention sees, position by position (zeros where the dense batch pads),
    through merge, multi-token and single-token steps, extend, filter, trim and extract."""
    rng = np.random.default_rng(0)
    pool = BlockPool(block_size=4, num_blocks=64)

    def rows(lengths: list[int]) -> tuple[Any, Any]:
        dense, paged = [], []
        for n in lengths:
            k, v = random_kv(rng, 1, n)
            dense.append(KVCache())
            paged.append(PagedKVCache(pool))
            dense[-1].update_and_fetch(k, v)
            paged[-1].update_and_fetch(k, v)
        return KVCache.merge(dense), PagedKVCache.merge(paged)

    def same(d: Any, p: Any, n: int) -> None:
        k, v = random_kv(rng, len(p.tables), n)
        for a, b in zip(d.update_and_fetch(k, v), p.update_and_fetch(k, v)):
            assert a.shape == b.shape and np.array_equal(np.array(a), np.array(b))
        assert d.offset.tolist() == p.offset.tolist() and d.size() == p.size()
        assert d.left_padding.tolist() == p.left_padding.tolist()
        assert np.array_equal(np.array(d.make_mask(n)), np.array(p.make_mask(n)))

    dense, paged = rows([5, 20, 13])
    same(dense, paged, 3)
    same(dense, paged, 1)
    d2, p2 = rows([30])
    dense.extend(d2)
    paged.extend(p2)
    same(dense, paged, 1)
    dense.filter(mx.array([2, 3]))
    paged.filter(mx.array([2, 3]))
    same(dense, paged, 2)
    assert dense.trim(5) == paged.trim(5) == 5
    same(dense, paged, 1)
    solo_d, solo_p = dense.extract(0), paged.extract(0)
    assert solo_d.offset == solo_p.offset == 13 + 3 + 1 + 1 + 2 - 5 + 1
    assert np.array_equal(np.array(solo_d.keys), np.array(solo_p.portable().keys))


def test_copy_on_write_needs_a_free_block_and_leaves_the_donor_intact() -> None:
    rng = np.random.default_rng(1)
    pool = BlockPool(block_size=4, num_blocks=3)
    donor = PagedKVCache(pool)
    donor.update_and_fetch(*random_kv(rng, 1, 6))      # one full block, one half-filled
    before = np.array(donor.portable().keys)
    borrower = donor.lend()
    other = PagedKVCache(pool)
    other.update_and_fetch(*random_kv(rng, 1, 4))      # the last free block
    with pytest.raises(PoolExhausted, match="needs 1 blocks of 4 tokens but only 0 of 3"):
        borrower.update_and_fetch(*random_kv(rng, 1, 1))   # fits its block, but that is shared
    assert borrower.offset == 6 and borrower.table.ids == donor.table.ids
    assert (pool.num_free, pool.num_shared) == (0, 2)
    del other
    borrower.update_and_fetch(*random_kv(rng, 1, 2))
    assert borrower.table.ids[0] == donor.table.ids[0] and borrower.table.ids[1] != donor.table.ids[1]
    assert np.array_equal(np.array(donor.portable().keys), before)
    assert np.array_equal(np.array(borrower.portable().keys)[..., :6, :], before)
    assert (pool.num_free, pool.num_shared) == (0, 1)
    del donor, borrower
    assert_no_leak({0: pool})
