"""Per-layer KV caches taken apart and rebuilt through mlx-lm's cache protocol: `state` (the
arrays and settings a cache holds) and `type(cache).from_state(state)` (a cache rebuilt from
them without `__init__`), as mlx_lm.models.cache's classes implement it and pipeserve/kv/'s
caches do too. The prompt cache lends, owns and stores caches only through it, never through
their attributes. Engine thread.

mlx-lm 0.32 has no separate `meta_state`: settings (bits, group size, block table, conversion
boundary, ...) are part of `state`, as in its QuantizedKVCache."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
                                  can_trim_prompt_cache, make_prompt_cache)

from pipeserve.kv.delayed import DelayedKVCache
from pipeserve.kv.quantized import AffineKVCache
from pipeserve.kv.turbo import TurboKVCache

# Per-row layouts whose every 4-D array in `state` is (B, H, capacity, ·) with `offset` tokens
# from the start: capacity past `offset` is preallocated, never content.
PREFIX_LAYOUTS = (KVCache, QuantizedKVCache, AffineKVCache, TurboKVCache, DelayedKVCache)


@dataclass(eq=False)
class Block:
    """Arrays several rows' copies live in together (`RowStore.copies_of`: rows leaving one
    batch at once, copied with one gather a layer, not one copy per row and layer); each
    row's caches are views of them. Its bytes stay held while any of those views does."""

    arrays: list[mx.array]
    nbytes: int
    queued: bool = False   # handed to the device for evaluation (once, by whoever puts first)


class SharedKVCache(KVCache):
    """A row's copy as views of a `Block` (`keys`, `values`: exactly its content); a prompt
    cache that keeps it counts the block, not the views (pipeserve/prompt_cache/ram.py)."""

    block: Block


def map_arrays(fn: Callable[[mx.array], mx.array], state: Any) -> Any:
    """`state` with `fn` applied to each array in it (tuples stay tuples, lists lists)."""
    return tree_map(lambda v: fn(v) if isinstance(v, mx.array) else v, state)


def rebuild(layer: Any, fn: Callable[[mx.array], mx.array], state: Any = None) -> Any:
    """A new cache of `layer`'s class from its state (or `state`), each array passed through
    `fn`. mlx-lm's CacheList rebuilds its members by class name from mlx-lm's own module, so
    it is rebuilt member by member instead."""
    if isinstance(layer, CacheList):
        return CacheList(*(rebuild(c, fn) for c in layer.caches))
    return type(layer).from_state(map_arrays(fn, layer.state if state is None else state))


def lend(layer: Any) -> Any:
    """A new cache object over the same buffers: writes to it (MLX slice updates rebind the
    array object) never reach `layer`, and nothing is copied until one happens. Pool-backed
    caches (kv=paged) take their own reference to the blocks in `from_state`."""
    return rebuild(layer, lambda a: a[...])


def lend_prefix(layer: Any, n: int, total: int) -> Any:
    """`layer` (holding `total` tokens) lent over its first `n`: `lend`, then trimmed to `n`
    and `shrink`-ed. A plain KVCache is two views built at once, no rebuilds: a burst of 128
    prompt-cache hits lends 3,584 layers, and the rebuilds were most of its admission."""
    if type(layer) is KVCache and layer.keys is not None:
        c = KVCache()
        c.keys, c.values, c.offset = layer.keys[..., :n, :], layer.values[..., :n, :], n
        return c
    c = lend(layer)
    if n < total:
        c.trim(total - n)
        c = shrink(c)
    return c


def shrink(layer: Any) -> Any:
    """`layer` over exactly its content (views of its first `offset` tokens): after a trim,
    its first write copies those tokens, not the longer entry behind them, and the row it
    serves holds no more than it uses."""
    if isinstance(layer, CacheList):
        return CacheList(*(shrink(c) for c in layer.caches))
    if type(layer) not in PREFIX_LAYOUTS:
        return layer
    return type(layer).from_state(content_state(layer))


def reserve(caches: list[Any], capacity: int) -> list[Any]:
    """A hit's plain KV caches (mlx-lm's KVCache) rebuilt with room for `capacity` tokens,
    where the row's next prompt chunk ends: the chunk writes in place, and the row's buffers
    then grow through the same sizes as a cold row's, which MLX's allocator already holds. An
    exact-size prefix of n tokens grows to n + 2048, n + 4096, ...: sizes no cold row makes,
    allocated anew for each new hit length. Other layouts are returned as they are."""
    out = []
    for c in caches:
        if type(c) is not KVCache or c.keys is None or c.keys.shape[2] >= capacity:
            out.append(c)
            continue
        n, grown = c.offset, KVCache()
        for name in ("keys", "values"):
            a = getattr(c, name)
            room = mx.zeros((*a.shape[:2], capacity, a.shape[3]), a.dtype)
            room[..., :n, :] = a[..., :n, :]
            setattr(grown, name, room)
        grown.offset = n
        out.append(grown)
    return out


def content_state(layer: Any) -> Any:
    """`layer.state` without preallocated capacity (PREFIX_LAYOUTS: every 4-D array cut to
    `offset` tokens); other layouts' state as it is."""
    state = layer.state
    if type(layer) not in PREFIX_LAYOUTS:
        return state
    n = layer.offset
    return map_arrays(lambda a: a[..., :n, :] if a.ndim == 4 else a, state)


def rewinds(model: Any) -> bool:
    """Whether every layer's cache of `model` can be cut back to any prefix (attention-only):
    then a cached entry serves every prompt that shares a prefix with it. Recurrent layers
    cannot rewind, nor can sliding-window ones past their window. Builds cache objects only
    (no arrays), so any thread may ask."""
    caches = make_prompt_cache(model)
    return can_trim_prompt_cache(caches) and not any(
        isinstance(c, RotatingKVCache) for c in caches)
