"""TurboQuant KV layout (`kv=turbo`): keys affine-quantized by mx.quantize; values rotated by a
randomized Hadamard transform, scaled per group by their RMS and Lloyd-Max quantized, indices
packed by bit plane. Per-row and batched caches with mlx-lm's semantics. Engine thread."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from pipeserve.kv.padded import LeftPaddedBatch
from pipeserve.kv.turbo_codec import (  # the codec; re-exported for callers
    CONVERT_CHUNK, GROUP_SIZES, K_BITS, MIN_HEAD_DIM, ROTATION_SEED, STEP, V_BITS,
    V_GROUP_SIZES, _check_params, check_turbo, decode_values, encode_keys, encode_values,
    gaussian_distortion, lloyd_max, pack_bits, rotate, rotation_matrix, turbo_attention,
    turbo_bytes_per_token, unpack_bits, unrotate)

__all__ = [
    "TurboKVCache", "BatchTurboKVCache", "K_BITS", "V_BITS", "GROUP_SIZES", "V_GROUP_SIZES",
    "MIN_HEAD_DIM", "ROTATION_SEED", "check_turbo", "turbo_bytes_per_token", "lloyd_max",
    "gaussian_distortion", "rotation_matrix", "rotate", "unrotate", "pack_bits", "unpack_bits",
    "encode_values", "decode_values", "encode_keys", "turbo_attention"]


# -- caches ----------------------------------------------------------------------------------
Parts = tuple  # tuple[mx.array, ...], each (B, n_kv_heads, capacity, last)


def _append(parts: Parts | None, used: int, new: Parts) -> Parts:
    """Write `new` at tokens [used, used + n) of `parts`, growing capacity by whole STEPs."""
    n = new[0].shape[2]
    if parts is None or used + n > parts[0].shape[2]:
        grow = (n + STEP - 1) // STEP * STEP
        fresh = tuple(mx.zeros((*a.shape[:2], grow, a.shape[3]), a.dtype) for a in new)
        parts = fresh if parts is None else tuple(
            mx.concatenate([p[..., :used, :], z], axis=2) for p, z in zip(parts, fresh))
    for p, a in zip(parts, new):
        p[..., used:used + n, :] = a
    return parts


def _view(parts: Parts, start: int, stop: int) -> Parts:
    return tuple(p[..., start:stop, :] for p in parts)


def _nbytes(*groups: Parts | None) -> int:
    return sum(p.nbytes for g in groups if g is not None for p in g)


def _empty_like(parts: Parts, batch: int) -> Parts:
    return tuple(mx.zeros((batch, p.shape[1], 0, p.shape[3]), p.dtype) for p in parts)


class _Turbo(_BaseCache):
    """What both layouts share: bit widths, encoding a chunk, attention."""

    keys: Parts | None
    values: Parts | None

    def _init_params(self, k_bits: int, v_bits: int, group_size: int, v_group_size: int) -> None:
        _check_params(k_bits, v_bits, group_size, v_group_size)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.group_size, self.v_group_size = group_size, v_group_size
        self.seed = ROTATION_SEED
        self.keys = self.values = None

    @property
    def params(self) -> dict[str, int]:
        return {"k_bits": self.k_bits, "v_bits": self.v_bits, "group_size": self.group_size,
                "v_group_size": self.v_group_size}

    def _store(self, used: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is None:
            check_turbo(keys.shape[-1], **self.params)
            check_turbo(values.shape[-1], **self.params)
        new_k = encode_keys(keys, self.k_bits, self.group_size)
        new_v = encode_values(values, self.v_bits, self.v_group_size, self.seed)
        self.keys = _append(self.keys, used, new_k)
        self.values = _append(self.values, used, new_v)

    def _store_chunked(self, keys: mx.array, values: mx.array) -> None:
        """Encode a long dense prefix chunk by chunk, so temporaries stay one chunk's size."""
        for start in range(0, keys.shape[2], CONVERT_CHUNK):
            stop = min(start + CONVERT_CHUNK, keys.shape[2])
            self.update_and_fetch(keys[..., start:stop, :], values[..., start:stop, :])
            mx.eval(self.keys, self.values)

    def attend(self, queries: mx.array, keys: Parts, values: Parts, *, scale: float,
               mask: Any) -> mx.array:
        """Attention over what update_and_fetch returned (pipeserve.kv.attention.dispatch)."""
        return turbo_attention(queries, keys, values, scale=scale, mask=mask, k_bits=self.k_bits,
                               v_bits=self.v_bits, group_size=self.group_size, seed=self.seed)

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


class TurboKVCache(_Turbo):
    """One row (batch 1) of one attention layer: mlx-lm KVCache semantics over TurboQuant
    storage. update_and_fetch returns (key parts, value parts) for `attend`, valid until the
    next update."""

    def __init__(self, k_bits: int = 8, v_bits: int = 3, group_size: int = 64,
                 v_group_size: int = 64) -> None:
        self._init_params(k_bits, v_bits, group_size, v_group_size)
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        self._store(self.offset, keys, values)
        self.offset += keys.shape[2]
        return _view(self.keys, 0, self.offset), _view(self.values, 0, self.offset)

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.k_bits, self.v_bits, self.group_size,
                self.v_group_size, self.seed)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.k_bits, self.v_bits, self.group_size,
         self.v_group_size, self.seed) = v

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @classmethod
    def merge(cls, caches: list[TurboKVCache]) -> BatchTurboKVCache:
        return BatchTurboKVCache.merge(caches)

    @classmethod
    def from_dense(cls, dense: Any, **params: int) -> TurboKVCache:
        """Encode an mlx-lm KVCache's tokens (the cache itself is left as it was)."""
        cache = cls(**params)
        if dense.keys is not None and dense.offset:
            cache._store_chunked(dense.keys[..., :dense.offset, :],
                                 dense.values[..., :dense.offset, :])
        return cache


class BatchTurboKVCache(_Turbo, LeftPaddedBatch):
    """Rows of one attention layer, left-padded to a shared length: mlx-lm BatchKVCache
    semantics (left_padding, per-row `offset` array, shared write index `_idx`)."""

    def __init__(self, left_padding: list[int], k_bits: int = 8, v_bits: int = 3,
                 group_size: int = 64, v_group_size: int = 64) -> None:
        self._init_params(k_bits, v_bits, group_size, v_group_size)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        self._store(self._idx, keys, values)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return _view(self.keys, 0, self._idx), _view(self.values, 0, self._idx)

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.left_padding, self._idx, self.k_bits,
                self.v_bits, self.group_size, self.v_group_size, self.seed)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.left_padding, self._idx, self.k_bits,
         self.v_bits, self.group_size, self.v_group_size, self.seed) = v
        self._right_padding = None

    def extend(self, other: BatchTurboKVCache) -> None:
        """Append `other`'s rows, right-aligning both at the longer write index."""
        if self.params != other.params:
            raise ValueError(f"cannot batch turbo caches with {self.params} and {other.params}")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        width = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = self if self.keys is not None else other
        aligned = [c._aligned(idx, width, template) for c in (self, other)]
        self.keys = tuple(mx.concatenate(ps) for ps in zip(*(a[0] for a in aligned)))
        self.values = tuple(mx.concatenate(ps) for ps in zip(*(a[1] for a in aligned)))
        self.left_padding = mx.concatenate([a[2] for a in aligned])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def _aligned(self, idx: int, width: int, template: BatchTurboKVCache
                 ) -> tuple[Parts, Parts, mx.array]:
        """Parts padded so that this cache's write index lands at `idx` and capacity is `width`."""
        rows = self.offset.shape[0]
        keys = self.keys or _empty_like(template.keys, rows)
        values = self.values or _empty_like(template.values, rows)
        left = idx - self._idx
        right = width - keys[0].shape[2] - left
        if right < 0:
            keep = keys[0].shape[2] + right
            keys, values = _view(keys, 0, keep), _view(values, 0, keep)
            right = 0
        if left or right:
            keys = tuple(mx.pad(p, [(0, 0), (0, 0), (left, right), (0, 0)]) for p in keys)
            values = tuple(mx.pad(p, [(0, 0), (0, 0), (left, right), (0, 0)]) for p in values)
        return keys, values, self.left_padding + left

    def extract(self, idx: int, pad: int | None = None) -> TurboKVCache:
        """Row `idx` as its own per-row cache (padding dropped, arrays copied); `pad`: its left
        padding, when the caller has it on the host."""
        cache = TurboKVCache(**self.params)
        pad = self.left_padding.tolist()[idx] if pad is None else pad
        if self.keys is not None:
            cache.keys = tuple(mx.contiguous(p[idx:idx + 1, :, pad:self._idx]) for p in self.keys)
            cache.values = tuple(mx.contiguous(p[idx:idx + 1, :, pad:self._idx])
                                 for p in self.values)
        cache.offset = max(self._idx - pad, 0)
        return cache

    @classmethod
    def merge(cls, caches: list[TurboKVCache]) -> BatchTurboKVCache:
        """Per-row caches → one batch, each row right-aligned (left-padded) to the longest."""
        params = caches[0].params
        for c in caches:
            if c.params != params:
                raise ValueError(f"cannot batch turbo caches with {params} and {c.params}")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], **params)
        full = [c for c in caches if c.keys is not None and c.offset]
        if not full:
            return batch
        keys = tuple(mx.zeros((len(caches), p.shape[1], longest, p.shape[3]), p.dtype)
                     for p in full[0].keys)
        values = tuple(mx.zeros((len(caches), p.shape[1], longest, p.shape[3]), p.dtype)
                       for p in full[0].values)
        for i, c in enumerate(caches):
            if c.keys is None or not c.offset:
                continue
            start = longest - c.offset
            for dst, src in zip(keys + values, c.keys + c.values):
                dst[i:i + 1, :, start:] = src[..., :c.offset, :]
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @classmethod
    def from_dense(cls, dense: Any, **params: int) -> BatchTurboKVCache:
        """Encode an mlx-lm BatchKVCache's rows, keeping its padding and offsets."""
        cache = cls([0] * dense.offset.shape[0], **params)
        if dense.keys is not None and dense._idx:
            cache._store_chunked(dense.keys[..., :dense._idx, :], dense.values[..., :dense._idx, :])
        # copies: mlx-lm updates these arrays in place (`+=`), which must not reach this cache
        cache.left_padding, cache.offset = mx.array(dense.left_padding), mx.array(dense.offset)
        cache._idx = dense._idx
        pending = getattr(dense, "_right_padding", None)
        cache._right_padding = None if pending is None else mx.array(pending)
        return cache
