"""The block pool behind kv=paged: one attention layer's KV blocks, a free list and a reference
count per block, copy-on-write growth, scatter of new tokens and gather into mlx-lm's dense
layout. Backing memory grows with the blocks in use. Engine thread (reference counts are
locked: a cache freed by the garbage collector may release blocks from another thread)."""
from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from pipeserve.errors import ServeError


class PoolExhausted(ServeError):
    """A write needs more free blocks than the layer's pool has (503: rows finishing free
    blocks, so the same request can fit later). Raised before anything is written."""

    status = 503
    error_type = "kv_pool_exhausted"


class BlockPool:
    """One attention layer's KV blocks: `keys`/`values` of shape (num_blocks, n_kv_heads,
    block_size, head_dim), allocated on the first write (dtype and shape from those keys), a
    free list and a reference count per block. A block is free (0), owned by one row (1) or
    shared by several rows / prompt-cache entries (>1); shared blocks are stored once."""

    def __init__(self, block_size: int = 256, num_blocks: int = 1024) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"block_size and num_blocks must be positive, got "
                             f"{block_size} and {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._shared = 0
        # called when a write needs more free blocks than there are: drops one holder of
        # blocks (the prompt cache's least recently used entry) and says whether it did
        self.reclaim: Callable[[], bool] | None = None
        # a cache collected by the garbage collector may release from another thread;
        # re-entrant because `reclaim` releases blocks from inside `grow`
        self._lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared(self) -> int:
        """Blocks referenced more than once (rows lent from one prefix, prompt-cache entries)."""
        return self._shared

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def stats(self) -> dict[str, int]:
        return {"blocks_used": self.num_used, "blocks_free": self.num_free,
                "blocks_shared": self.num_shared}

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (keys + values); 0 until the first write fixes the shape."""
        if self.keys is None:
            return 0
        return (self.keys.nbytes + self.values.nbytes) // self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes backed so far (grows with the peak number of blocks in use)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- references --------------------------------------------------------------------
    def _inc(self, block: int) -> None:
        self._refs[block] += 1
        if self._refs[block] == 2:
            self._shared += 1

    def _dec(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 1:
            self._shared -= 1
        elif self._refs[block] == 0:
            self._free.append(block)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def retain(self, ids: list[int]) -> None:
        """One more reference to each block in `ids` (a lent row or prompt-cache entry)."""
        with self._lock:
            for block in ids:
                self._inc(block)

    def release(self, ids: list[int]) -> None:
        """Drop one reference to each block in `ids` and empty the list (safe to call twice)."""
        with self._lock:
            for block in ids:
                self._dec(block)
            ids.clear()

    # -- writes --------------------------------------------------------------------------
    def blocks_needed(self, rows: list[tuple[list[int], int, int]]) -> int:
        """Free blocks that `grow(rows)` would take: new blocks plus copies of shared blocks
        that would be written (one copy per shared block less one holder, as `grow` does)."""
        need, pending = 0, {}
        for ids, n, add in rows:
            if add <= 0:
                continue
            need += self.blocks_for(n + add) - len(ids)
            if n % self.block_size:
                block = ids[n // self.block_size]
                if self._refs[block] - pending.get(block, 0) > 1:
                    need += 1
                    pending[block] = pending.get(block, 0) + 1
        return need

    def grow(self, rows: list[tuple[list[int], int, int]]) -> None:
        """Make each (ids, tokens held, tokens to add) able to take its new tokens: a shared,
        partly filled last block is copied first (copy-on-write), then new blocks are
        appended. All rows or none: raises PoolExhausted before changing anything."""
        with self._lock:
            src, dst = self._grow(rows)
        if src and self.keys is not None:
            self._reserve(max(dst) + 1)
            s, d = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
            self.keys[d] = self.keys[s]
            self.values[d] = self.values[s]

    def _grow(self, rows: list[tuple[list[int], int, int]]) -> tuple[list[int], list[int]]:
        need = self.blocks_needed(rows)
        while need > len(self._free) and self.reclaim is not None and self.reclaim():
            need = self.blocks_needed(rows)   # an evicted entry may have shared a block
        if need > len(self._free):
            raise PoolExhausted(
                f"KV block pool exhausted: this step needs {need} blocks of "
                f"{self.block_size} tokens but only {len(self._free)} of {self.num_blocks} are "
                f"free — raise kv.pool_blocks (or kv.pool_gb), or run fewer or shorter "
                f"requests at once", code="kv_pool_exhausted")
        src, dst = [], []
        for ids, n, add in rows:
            if add <= 0:
                continue
            if n % self.block_size:
                j = n // self.block_size
                if self._refs[ids[j]] > 1:
                    src.append(ids[j])
                    dst.append(self._take())
                    self._dec(ids[j])
                    ids[j] = dst[-1]
            while len(ids) < self.blocks_for(n + add):
                ids.append(self._take())
        return src, dst

    def _reserve(self, blocks: int) -> None:
        """Back at least `blocks` block ids with memory. The arrays grow by half as ids
        are handed out (low ids first), so memory follows the peak in use, not the pool's
        configured size, and a huge pool costs nothing until it fills."""
        have = self.keys.shape[0]
        if blocks <= have:
            return
        grow = min(self.num_blocks, max(blocks, have + have // 2)) - have

        def more(a: mx.array) -> mx.array:
            return mx.concatenate([a, mx.zeros((grow, *a.shape[1:]), a.dtype)])
        self.keys, self.values = more(self.keys), more(self.values)

    def _ensure(self, keys: mx.array, values: mx.array, blocks: int = 1) -> None:
        _, heads, _, k_dim = keys.shape
        v_dim = values.shape[3]
        if self.keys is None:
            first = min(self.num_blocks, max(blocks, 64))
            self.keys = mx.zeros((first, heads, self.block_size, k_dim), keys.dtype)
            self.values = mx.zeros((first, heads, self.block_size, v_dim), values.dtype)
            return
        want = (self.keys.shape[1], self.keys.shape[3], self.values.shape[3], self.keys.dtype)
        if (heads, k_dim, v_dim, keys.dtype) != want:
            raise ValueError(f"paged KV pool holds (heads, key dim, value dim, dtype) {want}, "
                             f"got {(heads, k_dim, v_dim, keys.dtype)}: one pool per layer")

    def write(self, keys: mx.array, values: mx.array,
              segments: list[tuple[list[int], int, int, int, int]]) -> None:
        """Scatter tokens into blocks already grown: each segment is (ids, first row position,
        batch row of `keys`, first and end token of `keys` along axis 2)."""
        upto = max((max(ids) + 1 for ids, *_ in segments if ids), default=1)
        self._ensure(keys, values, upto)
        self._reserve(upto)
        bs = self.block_size
        dst_b, dst_w, src_r, src_t = [], [], [], []
        for ids, pos, row, t0, t1 in segments:
            p = np.arange(pos, pos + t1 - t0)
            dst_b.append(np.asarray(ids, dtype=np.int32)[p // bs])
            dst_w.append(p % bs)
            src_r.append(np.full(t1 - t0, row))
            src_t.append(np.arange(t0, t1))
        if not dst_b:
            return
        b, w = (mx.array(np.concatenate(x).astype(np.int32))[:, None] for x in (dst_b, dst_w))
        r, t = (mx.array(np.concatenate(x).astype(np.int32))[:, None] for x in (src_r, src_t))
        heads = mx.arange(keys.shape[1])[None]
        self.keys[b, heads, w] = keys[r, heads, t]
        self.values[b, heads, w] = values[r, heads, t]

    def gather(self, tables: list[list[int]], lefts: list[int], counts: list[int],
               width: int) -> tuple[mx.array, mx.array]:
        """(B, H, width, D) keys and values: row i's `counts[i]` tokens start at position
        `lefts[i]`; every other position holds zeros (the padding a dense batch masks)."""
        bs = self.block_size
        if len(tables) == 1 and lefts[0] == 0 and counts[0] == width:
            # one row, no padding: whole blocks, laid end to end (no per-token gather)
            idx = mx.array(tables[0][:-(-width // bs)] or [0], dtype=mx.int32)

            def row(pool: mx.array) -> mx.array:
                x = pool[idx].swapaxes(0, 1)   # (H, blocks, bs, D)
                return x.reshape(1, x.shape[0], -1, x.shape[-1])[:, :, :width]
            return row(self.keys), row(self.values)
        table = np.zeros((len(tables), max(1, max(len(t) for t in tables))), dtype=np.int32)
        for i, ids in enumerate(tables):
            table[i, :len(ids)] = ids
        tok = mx.arange(width)[None] - mx.array(lefts, dtype=mx.int32)[:, None]
        padded = any(lefts) or any(c < width - l for c, l in zip(counts, lefts))
        valid = (tok >= 0) & (tok < mx.array(counts, dtype=mx.int32)[:, None])
        tok = mx.clip(tok, 0, table.shape[1] * bs - 1)
        b = mx.take_along_axis(mx.array(table), tok // bs, axis=1)[:, None]
        w = (tok % bs)[:, None]
        heads = mx.arange(self.keys.shape[1])[None, :, None]
        keys, values = self.keys[b, heads, w], self.values[b, heads, w]
        if padded:
            keep = valid[:, None, :, None]
            keys, values = mx.where(keep, keys, 0), mx.where(keep, values, 0)
        return keys, values
