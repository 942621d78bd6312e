"""Bookkeeping shared by the batched quantized caches (affine, TurboQuant): rows left-padded
to one write position, as in mlx-lm's BatchKVCache, with keys and values stored as tuples of
arrays (data, scales, ...) whose token axis is -2. Engine thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, _BaseCache


def roll_rows(xs: Sequence[mx.array], shifts: mx.array) -> list[mx.array]:
    """Each row's positions (axis 2 of a (rows, heads, positions, ...) array) rolled right by
    its own shift, as mlx-lm's `dynamic_roll`: one gather of whole (row, head, position)
    vectors from the array seen as (rows·heads·positions, ...), where dynamic_roll gathers
    element by element (an order of magnitude slower, on the GPU and the CPU alike; the
    figures: docs/notes). The same values either way."""
    index: dict[tuple[int, int, int], mx.array] = {}
    out = []
    for x in xs:
        rows, heads, n = x.shape[:3]
        key = (rows, heads, n)
        if key not in index:
            first = (mx.arange(rows)[:, None, None] * heads + mx.arange(heads)[None, :, None]) * n
            index[key] = (first + (mx.arange(n)[None, None, :] - shifts[:, None, None]) % n
                          ).reshape(-1)
        flat = x.reshape(rows * heads * n, *x.shape[3:])
        out.append(mx.take(flat, index[key], axis=0).reshape(x.shape))
    return out


def finalize(cache: Any) -> None:
    """`cache.finalize()` after a right-padded forward; mlx-lm's batched caches (plain and
    sliding-window) roll the padding to the left by `roll_rows` here, where their own
    finalize rolls element by element. The same state either way."""
    if type(cache) is BatchKVCache and cache._right_padding is not None:
        shift = cache._right_padding
        cache._right_padding = None
    elif type(cache) is BatchRotatingKVCache and cache._lengths is not None:
        shift = mx.maximum(0, cache.offset - cache._lengths)
        cache._lengths = None
    else:
        cache.finalize()
        return
    cache.keys, cache.values = roll_rows([cache.keys, cache.values], shift)
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift


class LeftPaddedBatch(_BaseCache):
    """Subclasses set `keys`/`values` (tuples of (B, H, T, ·) arrays, or None), `offset` and
    `left_padding` (per-row arrays) and `_idx` (the shared write position)."""

    keys: tuple[mx.array, ...] | None
    values: tuple[mx.array, ...] | None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        """As BatchKVCache.prepare: add left padding to an empty batch, or note the right
        padding of a right-padded forward (rolled to the left by the subclass's `finalize`)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(f"left padding can only be added to an empty "
                                 f"{type(self).__name__}")
            self.left_padding = self.left_padding + mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """After a right-padded forward: roll each row's padding to its left edge."""
        if self._right_padding is None:
            return
        if self.keys is not None:
            rolled = roll_rows([*self.keys, *self.values], self._right_padding)
            self.keys, self.values = tuple(rolled[:len(self.keys)]), tuple(rolled[len(self.keys):])
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    def filter(self, batch_indices: mx.array, kept_padding: list[int] | None = None) -> None:
        """Keep only the rows `batch_indices`, in that order; drop padding they all share.
        `kept_padding`: those rows' left padding, when the caller has it on the host (no read
        from the device)."""
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.offset = self.offset[batch_indices]
        if kept_padding is None:
            self.left_padding = self.left_padding[batch_indices]
            kept_padding = self.left_padding.tolist()
        else:
            self.left_padding = mx.array(kept_padding)
        shared = min(kept_padding)
        if shared > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shared:, :] for x in self.keys)
                self.values = tuple(x[..., shared:, :] for x in self.values)
            self._idx -= shared
            self.left_padding = self.left_padding - shared
