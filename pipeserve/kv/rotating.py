"""Rolling back sliding-window layers (mlx-lm's RotatingKVCache / BatchRotatingKVCache) after
a verify forward. A verify feeds several positions per row, which mlx-lm's rotating caches take
through their concatenating update: the buffer is put in temporal order, cut to the last
window - 1 positions and the new ones are appended, so nothing a rollback needs is overwritten
in place. Dropping a row's rejected positions is then a cut at the buffer's end (a batched
row's surplus rolls to its left edge and becomes masked padding, as a trimmed full-attention
row's does); the next one-token update trims the buffer back to the window. Engine thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from pipeserve.kv.padded import roll_rows


def is_rotating(cache: Any) -> bool:
    return isinstance(cache, (RotatingKVCache, BatchRotatingKVCache))


def rewind_rotating(cache: RotatingKVCache, n: int) -> None:
    """Drop the last `n` positions of one row's sliding-window cache, fed by a multi-token
    forward (its buffer is in temporal order, nothing overwritten)."""
    if n <= 0 or cache.keys is None:
        return
    assert cache._idx == cache.keys.shape[2], "a rotating rollback after a one-token update"
    n = cache.trim(n)
    cache.keys = cache.keys[..., :cache._idx, :]
    cache.values = cache.values[..., :cache._idx, :]


def rewind_rotating_rows(cache: BatchRotatingKVCache, drop: Sequence[int]) -> None:
    """Drop the last `drop[i]` positions of row i of a batched sliding-window cache: what every
    row drops is cut off the end, each row's remaining surplus rolls to its left edge, where the
    mask reads it as padding."""
    if not any(drop) or cache.keys is None:
        return
    assert not cache.rotated and cache._idx == cache.keys.shape[2], \
        "a rotating rollback after a one-token update"
    common = min(drop)
    if common:
        cache.trim(common)
        cache.keys = cache.keys[..., :cache._idx, :]
        cache.values = cache.values[..., :cache._idx, :]
    rest = [d - common for d in drop]
    if any(rest):
        shift = mx.array(rest, dtype=mx.int32)
        cache.keys, cache.values = roll_rows([cache.keys, cache.values], shift)
        cache.left_padding = cache.left_padding + shift
        cache.offset = cache.offset - shift


def window_of(cache: RotatingKVCache, n: int) -> tuple[mx.array, mx.array]:
    """One row's last min(n, window) keys and values in temporal order, (1, heads, m, dim):
    what a sliding-window layer's next query may attend to."""
    m = min(n, cache.max_size)
    keys = cache._temporal_order(cache.keys)
    values = cache._temporal_order(cache.values)
    return keys[..., keys.shape[2] - m:, :], values[..., values.shape[2] - m:, :]
