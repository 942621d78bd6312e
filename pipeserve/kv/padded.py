"""Bookkeeping shared by the batched quantized caches (affine, TurboQuant): rows left-padded
to one write position, as in mlx-lm's BatchKVCache, with keys and values stored as tuples of
arrays (data, scales, ...) whose token axis is -2. Engine thread."""
from __future__ import annotations

import hashlib
import inspect
import os
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


def _digest(cls: type) -> str:
    try:
        return hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16]
    except (OSError, TypeError):   # no source to read (an install without .py files)
        return ""


# A plain batched layer's left padding, as host ints beside the array they were noted for.
# Reading the array back waits for every step queued on the device (the drain's copies read it
# while a step is in flight). Every change pipeserve makes to a plain layer's padding binds a
# new array, so a copy noted for the array the layer holds is current. mlx-lm's BatchKVCache
# changes one in place only in prepare(left_padding) and finalize, which pipeserve never calls
# on a plain layer (pad_left, finalize below), and in filter, on an array it just made: as read
# in this class's source; another mlx-lm's keeps no notes (tests/kv/test_noted_padding.py
# fails). PIPESERVE_CHECK_PADDING=1 (the test suite) checks each noted copy against the device.
NOTES = _digest(BatchKVCache) == "474e6fe46261a118"
CHECK_PADDING = os.environ.get("PIPESERVE_CHECK_PADDING") == "1"


def noted_padding(cache: Any) -> list[int] | None:
    """The host copy of a plain batched layer's left padding noted for the array it holds now;
    None: none was, or the layer has since bound another (read it from the device)."""
    held = getattr(cache, "_host_padding", None)
    return held[1] if held is not None and held[0] is cache.left_padding else None


def note_padding(cache: Any, values: list[int] | None) -> None:
    """Note `values` as a plain batched layer's left padding, for the array it holds now."""
    if NOTES and values is not None and type(cache) is BatchKVCache:
        cache._host_padding = (cache.left_padding, values)


def note_right_padding(cache: Any, values: list[int]) -> None:
    """The host copy of a plain layer's right padding (just set, `_right_padding`), for
    `finalize` to note the left padding it makes."""
    if NOTES and type(cache) is BatchKVCache and cache._right_padding is not None:
        cache._host_right = (cache._right_padding, values)


def finalize(cache: Any) -> None:
    """`cache.finalize()` after a right-padded forward; mlx-lm's batched caches (plain and
    sliding-window) roll the padding to the left by `roll_rows` here, where their own
    finalize rolls element by element. The same state either way."""
    left = right = None
    if type(cache) is BatchKVCache and cache._right_padding is not None:
        shift = cache._right_padding
        cache._right_padding = None
        held = cache.__dict__.pop("_host_right", None)
        left = noted_padding(cache)
        right = held[1] if held is not None and held[0] is shift else None
    elif type(cache) is BatchRotatingKVCache and cache._lengths is not None:
        shift = mx.maximum(0, cache.offset - cache._lengths)
        cache._lengths = None
    else:
        cache.finalize()
        return
    cache.keys, cache.values = roll_rows([cache.keys, cache.values], shift)
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift
    if left is not None and right is not None:
        note_padding(cache, [a + b for a, b in zip(left, right)])


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
