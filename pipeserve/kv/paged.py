"""kv=paged: fixed-size KV blocks in one pool per attention layer, block tables per row, prefix
blocks shared between rows and the prompt cache (reference counts, copy-on-write). Each fetch
gathers a row's blocks into mlx-lm's dense layout, so the stock attention runs unchanged and the
results equal KVCache / BatchKVCache exactly. Engine thread only.

Caches hold a reference to their pool, so the SSD codec must store `portable()` (a plain
KVCache) and restore with `PagedKVCache.from_portable(kv, pool)`. A row's blocks go back to the
pool when its cache object is collected (CPython frees at the last reference; a cache caught in
a reference cycle waits for the garbage collector)."""
from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from pipeserve.kv.pool import BlockPool, PoolExhausted

__all__ = ["BlockPool", "PoolExhausted", "PagedKVCache", "BatchPagedKVCache", "make_pools",
           "paged_cache"]


class _Table:
    """The block ids one row holds, one pool reference each, released when this object is
    collected. `ids` is mutated in place only: the finalizer holds that very list."""

    __slots__ = ("pool", "ids", "__weakref__")

    def __init__(self, pool: BlockPool, ids: list[int] | None = None) -> None:
        self.pool = pool
        self.ids = ids if ids is not None else []
        weakref.finalize(self, pool.release, self.ids)

    def lend(self) -> _Table:
        self.pool.retain(self.ids)
        return _Table(self.pool, list(self.ids))

    def cut(self, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens."""
        keep = self.pool.blocks_for(max(0, num_tokens))
        tail = self.ids[keep:]
        del self.ids[keep:]
        self.pool.release(tail)


class PagedKVCache(_BaseCache):
    """One row (batch 1) of one layer: a block table and `offset` tokens. Behaves as mlx-lm's
    KVCache (same fetched values and shapes, trim, mask, merge). `lend()`, `copy.copy`,
    `copy.deepcopy` and `from_state(state)` share the blocks (no copy; the first write into a
    shared block copies it)."""

    def __init__(self, pool: BlockPool, *, table: _Table | None = None, offset: int = 0) -> None:
        self.pool = pool
        self.table = table if table is not None else _Table(pool)
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != 1:
            raise ValueError(f"PagedKVCache holds one row, got a batch of {keys.shape[0]}; "
                             "merge rows into a BatchPagedKVCache")
        self._append(keys, values)
        return self.pool.gather([self.table.ids], [0], [self.offset], self.offset)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        self.pool.grow([(self.table.ids, self.offset, n)])
        self.pool.write(keys, values, [(self.table.ids, self.offset, 0, 0, n)])
        self.offset += n

    def blocks_needed(self, num_tokens: int) -> int:
        """Free blocks a write of `num_tokens` more tokens would take (for admission checks)."""
        return self.pool.blocks_needed([(self.table.ids, self.offset, num_tokens)])

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self.table.cut(self.offset)
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self) -> tuple[Any, ...]:
        """(pool keys, pool values, block table, offset): the arrays a write changes (so
        `mx.eval(state)` completes it) and what `from_state` rebuilds the row from. The table
        is bound to its pool, so state is lent, never stored: the SSD tier stores portable()."""
        return self.pool.keys, self.pool.values, self.table, self.offset

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        _, _, table, offset = v   # the pool's arrays: the table's pool holds them
        self.pool, self.table, self.offset = table.pool, table.lend(), offset   # own reference

    @property
    def nbytes(self) -> int:
        return len(self.table.ids) * self.pool.block_nbytes

    def lend(self) -> PagedKVCache:
        return PagedKVCache(self.pool, table=self.table.lend(), offset=self.offset)

    def __copy__(self) -> PagedKVCache:
        return self.lend()

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedKVCache:
        return self.lend()

    def portable(self) -> KVCache:
        """An equivalent plain mlx-lm KVCache (a dense copy), e.g. for the SSD tier."""
        kv = KVCache()
        if self.offset:
            keys, values = self.pool.gather([self.table.ids], [0], [self.offset], self.offset)
            kv.keys, kv.values, kv.offset = mx.contiguous(keys), mx.contiguous(values), self.offset
        return kv

    @classmethod
    def from_portable(cls, kv: KVCache, pool: BlockPool) -> PagedKVCache:
        cache = cls(pool)
        if kv.keys is not None and kv.offset:
            cache._append(kv.keys[..., :kv.offset, :], kv.values[..., :kv.offset, :])
        return cache

    @classmethod
    def merge(cls, caches: list[PagedKVCache]) -> BatchPagedKVCache:
        return BatchPagedKVCache.merge(caches)


class BatchPagedKVCache(_BaseCache):
    """Rows of one layer decoded together, with mlx-lm BatchKVCache's semantics: positions
    [0, _idx), row i's tokens right-aligned after `left_padding[i]`; `offset = _idx - left_padding`.
    Rows are stored without padding (row i holds max(0, _idx - left_padding[i]) tokens), so
    merge/extend/extract/filter only move block references, never KV data."""

    def __init__(self, pool: BlockPool, left_padding: list[int],
                 tables: list[_Table] | None = None) -> None:
        self.pool = pool
        self.lefts = [int(p) for p in left_padding]
        self.tables = tables if tables is not None else [_Table(pool) for _ in self.lefts]
        self._idx = 0
        self._right: list[int] | None = None

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self.lefts, dtype=mx.int32)

    @property
    def offset(self) -> mx.array:
        return mx.array([self._idx - p for p in self.lefts], dtype=mx.int32)

    def _count(self, i: int) -> int:
        return max(0, self._idx - self.lefts[i])

    def _plan(self, n: int) -> list[tuple[list[int], int, int, int, int]]:
        """Per row: (ids, tokens held, tokens to add, first and end input token to keep)."""
        plan = []
        for i, table in enumerate(self.tables):
            first = min(n, max(0, self.lefts[i] - self._idx))   # input positions still padding
            plan.append((table.ids, self._count(i), n - first, first, n))
        return plan

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        plan = self._plan(n)
        self.pool.grow([(ids, held, add) for ids, held, add, _, _ in plan])
        self.pool.write(keys, values, [(ids, held, i, t0, t1) for i, (ids, held, _, t0, t1)
                                       in enumerate(plan) if t1 > t0])
        self._idx += n
        return self.pool.gather([t.ids for t in self.tables], self.lefts,
                                [self._count(i) for i in range(len(self.tables))], self._idx)

    def blocks_needed(self, num_tokens: int) -> int:
        """Free blocks a step of `num_tokens` per row would take (for admission checks)."""
        return self.pool.blocks_needed([(ids, held, add)
                                        for ids, held, add, _, _ in self._plan(num_tokens)])

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if any(t.ids for t in self.tables):
                raise ValueError("Left padding can only be added to an empty BatchPagedKVCache")
            self.lefts = [p + int(x) for p, x in zip(self.lefts, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._right = [int(x) for x in right_padding]

    def finalize(self) -> None:
        """After a right-padded prefill: drop each row's trailing padding tokens, which the
        dense cache rolls to the front as left padding."""
        if self._right is None:
            return
        self.lefts = [p + r for p, r in zip(self.lefts, self._right)]
        for i, table in enumerate(self.tables):
            table.cut(self._count(i))
        self._right = None

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return not any(t.ids for t in self.tables)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        for i, table in enumerate(self.tables):
            table.cut(self._count(i))
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: mx.array | list[int]) -> None:
        """Keep the given rows (in that order) and drop the padding all of them share."""
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        assert len(set(keep)) == len(keep), "a row kept twice would share its block table"
        self.tables, self.lefts = [self.tables[i] for i in keep], [self.lefts[i] for i in keep]
        shift = min(self.lefts) if self.lefts else 0
        if shift > 0:
            self.lefts = [p - shift for p in self.lefts]
            self._idx -= shift

    def extend(self, other: BatchPagedKVCache) -> None:
        """Append `other`'s rows (sharing their blocks), right-aligning both at max(_idx)."""
        if other.pool is not self.pool:
            raise ValueError("cannot extend a BatchPagedKVCache with rows of another pool")
        idx = max(self._idx, other._idx)
        self.lefts = ([p + idx - self._idx for p in self.lefts]
                      + [p + idx - other._idx for p in other.lefts])
        self.tables = self.tables + [t.lend() for t in other.tables]
        self._idx = idx

    def extract(self, idx: int) -> PagedKVCache:
        """Row `idx` as its own PagedKVCache sharing its blocks (no copy)."""
        return PagedKVCache(self.pool, table=self.tables[idx].lend(), offset=self._count(idx))

    @classmethod
    def merge(cls, caches: list[PagedKVCache]) -> BatchPagedKVCache:
        """Per-row caches → one batch sharing their blocks (no copy), left-padded as mlx-lm."""
        width = max(c.offset for c in caches)
        batch = cls(caches[0].pool, [width - c.offset for c in caches],
                    [c.table.lend() for c in caches])
        if any(c.pool is not batch.pool for c in caches):
            raise ValueError("cannot merge PagedKVCache rows of different pools")
        batch._idx = width
        return batch

    @property
    def state(self) -> tuple[Any, ...]:
        """(pool keys, pool values, block tables, left paddings, _idx); as PagedKVCache's.
        Pending right padding (between prepare and finalize) is not kept, as in mlx-lm."""
        return self.pool.keys, self.pool.values, tuple(self.tables), tuple(self.lefts), self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        _, _, tables, lefts, idx = v
        if not tables:
            raise ValueError("an empty BatchPagedKVCache has no pool to be rebuilt in")
        self.pool = tables[0].pool
        self.tables = [t.lend() for t in tables]   # own references to the rows' blocks
        self.lefts, self._idx, self._right = list(lefts), idx, None

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct blocks the rows reference (a shared prefix counts once)."""
        return len({b for t in self.tables for b in t.ids}) * self.pool.block_nbytes


def paged_cache(model: Any, pools: dict[int, BlockPool]) -> list[Any]:
    """The model's mlx-lm cache list with a PagedKVCache wherever it makes a plain KVCache
    (`pools` maps those layer indices to their pools); sliding and recurrent layers unchanged."""
    from mlx_lm.models.cache import make_prompt_cache
    caches = make_prompt_cache(model)
    return [PagedKVCache(pools[i]) if type(c) is KVCache else c for i, c in enumerate(caches)]


def make_pools(model: Any, block_size: int, num_blocks: int) -> dict[int, BlockPool]:
    """One BlockPool per layer where mlx-lm makes a plain KVCache, keyed by layer index."""
    from mlx_lm.models.cache import make_prompt_cache
    return {i: BlockPool(block_size, num_blocks)
            for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache}
