"""Rows leaving one batch together are copied with one gather a layer into a shared block, each
row's caches views of it (`shared_rows`); the RAM tier counts a block once while any of its
entries is held, and copies the entries left out of it once they use less than half of it, so
the block is freed. Real MLX arrays in mlx-lm's BatchKVCache; no model."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache
from prometheus_client import CollectorRegistry

from pipeserve.core.rows import extract_rows, host_padding, shared_rows
from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.protocol import SharedKVCache
from pipeserve.prompt_cache.ram import RamPromptCache
from tests.conftest import make_config

LAYERS, HEADS, DIM = 3, 2, 8


def batch(pads: list[int], width: int) -> list[BatchKVCache]:
    """Layers of a left-padded batch: row i holds `width - pads[i]` positions of content."""
    out = []
    for layer in range(LAYERS):
        c = BatchKVCache(left_padding=pads)
        shape = (len(pads), HEADS, width, DIM)
        c.update_and_fetch(mx.random.normal(shape, key=mx.random.key(2 * layer)),
                           mx.random.normal(shape, key=mx.random.key(2 * layer + 1)))
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


@pytest.mark.parametrize("pads, rows", [
    ([2, 0, 1, 0], [(0, 38), (1, 40), (3, 39)]),   # (row, its first positions kept)
    ([0, 0, 0, 0], [(0, 40), (1, 40), (2, 40), (3, 40)]),   # one length: split, not sliced
], ids=["lengths", "one-length"])
def test_rows_of_one_batch_share_one_gather_a_layer_with_each_rows_exact_content(
        pads: list[int], rows: list[tuple[int, int]]) -> None:
    caches = batch(pads, 40)
    pads = host_padding(caches)
    shared = shared_rows(caches, rows, pads)
    plain = extract_rows(caches, [i for i, _ in rows], [u for _, u in rows], pads=pads)
    assert shared is not None
    block = shared[0][0].block
    assert len(block.arrays) == 2 * LAYERS   # keys and values of each layer: one copy each
    assert block.nbytes == sum(a.nbytes for a in block.arrays)
    for mine, theirs in zip(shared, plain):
        for c, p in zip(mine, theirs):
            assert isinstance(c, SharedKVCache) and c.block is block
            assert c.offset == p.offset and c.keys.shape == p.keys.shape
            assert mx.array_equal(c.keys, p.keys).item() and mx.array_equal(c.values, p.values).item()


def test_rows_of_very_different_lengths_are_copied_one_by_one() -> None:
    caches = batch([30, 0], 40)   # 10 positions against 40: most of a shared block unused
    assert shared_rows(caches, [(0, 10), (1, 40)], host_padding(caches)) is None


def put_rows(cache: RamPromptCache, n: int) -> tuple[list, list]:
    caches = batch([0] * n, 24)
    rows = shared_rows(caches, [(i, 24) for i in range(n)], host_padding(caches))
    tokens = [[100 * i + t for t in range(24)] for i in range(n)]
    with cache.batch():
        entries = [cache.put(t, r, handed=True) for t, r in zip(tokens, rows)]
    return entries, rows


def test_the_tier_counts_a_block_once_and_frees_it_with_its_last_entry() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    entries, rows = put_rows(cache, 4)
    block = rows[0][0].block
    assert all(e.block is block for e in entries)
    assert cache.nbytes == block.nbytes
    cache.remove(entries[0])   # three of four left: the block is still held whole
    assert cache.nbytes == block.nbytes and all(e.block is block for e in entries[1:])
    for e in entries[1:3]:
        cache.remove(e)
    # one of four left: it is copied out of the block, which nothing holds then
    left = entries[3]
    assert left.block is None
    assert cache.nbytes == left.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in left.caches)
    for c, was in zip(left.caches, rows[3]):
        assert mx.array_equal(c.keys, was.keys).item() and mx.array_equal(c.values, was.values).item()
    cache.remove(left)
    assert cache.nbytes == 0 and not cache._blocks


def test_eviction_under_the_byte_cap_counts_blocks_not_views() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    first, rows = put_rows(cache, 4)
    cache.max_bytes = int(1.5 * rows[0][0].block.nbytes)   # room for one block and a half
    second, rows2 = put_rows(cache, 4)
    # the oldest block's entries went, all of them, so the newer block fits
    assert set(cache.entries) == {e.key for e in second}
    assert cache.nbytes == rows2[0][0].block.nbytes <= cache.max_bytes


def test_a_blocks_rows_put_without_handing_them_over_are_copied_out() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    caches = batch([0, 0], 16)
    rows = shared_rows(caches, [(0, 16), (1, 16)], host_padding(caches))
    entry = cache.put(list(range(16)), rows[0], handed=False)
    assert entry.block is None and cache.nbytes == entry.nbytes
    assert entry.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in rows[0])


def test_a_row_too_large_for_the_tier_leaves_its_blocks_other_rows_whole() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    caches = batch([0, 0], 16)
    rows = shared_rows(caches, [(0, 16), (1, 16)], host_padding(caches))
    share = sum(c.keys.nbytes + c.values.nbytes for c in rows[0])
    cache.max_bytes = share - 1   # the first row alone is more than the tier
    with cache.batch():
        assert cache.put(list(range(16)), rows[0], handed=True) is None
    assert rows[0][0].block.queued and cache.nbytes == 0   # gathered, not kept
    cache.max_bytes = 10 * share
    kept = cache.put(list(range(100, 116)), rows[1], handed=True)
    assert kept is not None and cache.nbytes == rows[1][0].block.nbytes
    for c, was in zip(kept.caches, rows[1]):
        assert mx.array_equal(c.keys, was.keys).item()


def test_a_block_left_inside_a_batch_is_copied_out_at_its_end_and_only_if_still_held() -> None:
    """Rows finishing together each replace their prompt's entry within one `batch()`: a block
    whose entries all go in it is freed whole, none of them copied out at the half mark; one
    whose survivors outlive the batch is counted by their bytes at once and copied at its end."""
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    entries, rows = put_rows(cache, 4)
    block = rows[0][0].block
    with cache.batch():
        for e in entries:
            cache.remove(e)
    assert all(e.block is block for e in entries)   # never copied out
    assert cache.nbytes == 0 and not cache._blocks
    entries, rows = put_rows(cache, 4)
    block = rows[0][0].block
    with cache.batch():
        for e in entries[:3]:
            cache.remove(e)
        left = entries[3]
        assert left.block is block and cache.nbytes == left.nbytes   # counted as copied
    assert left.block is None and not cache._blocks
    assert cache.nbytes == left.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in left.caches)
    for c, was in zip(left.caches, rows[3]):
        assert mx.array_equal(c.keys, was.keys).item() and mx.array_equal(c.values, was.values).item()
