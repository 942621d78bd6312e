"""Affine-quantized KV caches (uniform q4/q8, and per-layer mixed key/value bits): a per-row cache,
the batched cache of the shared decode batch, and their attention. Engine thread only.

With k_bits == v_bits the storage and attention are exactly mlx-lm's QuantizedKVCache and
quantized_scaled_dot_product_attention (mx.quantize per token in groups along the head dim,
mx.quantized_matmul for scores and output). Keys and values are (wq, scales, biases) tuples that
grow in steps of 256 tokens. Attention runs through `attend` (pipeserve/kv/attention.py dispatch)."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache, create_attention_mask

from pipeserve.kv.attention import dense_attention, on_cuda
from pipeserve.kv.padded import LeftPaddedBatch

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
STEP = 256

Quantized = tuple[mx.array, mx.array, mx.array]   # (packed uint32, scales, biases)


def qmatmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, transpose: bool,
            group_size: int, bits: int) -> mx.array:
    """mx.quantized_matmul, except on CUDA, where MLX 0.32 has no kernel for attention's shapes
    (neither for a long prefill chunk nor for a one-row decode step against long quantized
    keys): there the operand is dequantized and multiplied in the activations'
    dtype. CPU and Metal take quantized_matmul (mlx-lm's arithmetic)."""
    if on_cuda():
        full = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(x.dtype)
        return x @ (full.swapaxes(-1, -2) if transpose else full)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose,
                               group_size=group_size, bits=bits)


def dequantized_attention(queries: mx.array, keys: Quantized, values: Quantized, *, scale: float,
                          mask: Any, group_size: int, k_bits: int, v_bits: int) -> mx.array:
    """The CUDA path: keys and values dequantized to the queries' dtype, then the dense
    attention (MLX's fused kernel, or the composed one for decode/verify steps). It reads the
    quantized bytes once and writes a transient dense copy, where quantized_attention's
    fallback multiplied broadcast copies per query head group."""
    k = mx.dequantize(*keys, group_size=group_size, bits=k_bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size=group_size, bits=v_bits).astype(queries.dtype)
    return dense_attention(queries, k, v, scale, mask)


def quantized_attention(queries: mx.array, keys: Quantized, values: Quantized, *, scale: float,
                        mask: Any, group_size: int, k_bits: int, v_bits: int) -> mx.array:
    """Attention over quantized keys/values; the same ops, in the same order, as mlx-lm's
    quantized_scaled_dot_product_attention, with separate key and value bit widths. `mask` is
    None, "causal", a bool array (True = attend) or an additive array. On CUDA:
    dequantized_attention."""
    if on_cuda():
        return dequantized_attention(queries, keys, values, scale=scale, mask=mask,
                                     group_size=group_size, k_bits=k_bits, v_bits=v_bits)
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        keys = tuple(mx.expand_dims(x, axis=-3) for x in keys)
        values = tuple(mx.expand_dims(x, axis=-3) for x in values)
    scores = qmatmul(queries, *keys, transpose=True, group_size=group_size, bits=k_bits)
    if mask is not None:
        if isinstance(mask, str):
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = qmatmul(scores, *values, transpose=False, group_size=group_size, bits=v_bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, out.shape[-1]))
    return out


def _check(k_bits: int, v_bits: int, group_size: int) -> None:
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if bits not in BITS:
            raise ValueError(f"{name} must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")


def _quantize(x: mx.array, group_size: int, bits: int) -> Quantized:
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _append(store: Quantized | None, new: Quantized, prev: int) -> Quantized:
    """Write `new` (B, H, n, w) at token `prev` of `store`, growing it by whole steps."""
    n = new[0].shape[2]
    if store is None or prev + n > store[0].shape[2]:
        grow = (STEP + n - 1) // STEP * STEP
        parts = []
        for i, y in enumerate(new):
            fresh = mx.zeros((*y.shape[:2], grow, y.shape[3]), dtype=y.dtype)
            parts.append(fresh if store is None
                         else mx.concatenate([store[i][..., :prev, :], fresh], axis=2))
        store = tuple(parts)
    for x, y in zip(store, new):
        x[..., prev:prev + n, :] = y
    return store


def _upto(store: Quantized, n: int) -> Quantized:
    return store if store[0].shape[2] == n else tuple(x[..., :n, :] for x in store)


def _nbytes(*stores: Quantized | None) -> int:
    return sum(x.nbytes for s in stores if s is not None for x in s)


class _Affine(_BaseCache):
    """What the row and batch caches share: attention over the quantized tuples, size."""

    keys: Quantized | None
    values: Quantized | None
    k_bits: int
    v_bits: int
    group_size: int

    def attend(self, queries: mx.array, keys: Quantized, values: Quantized, *, scale: float,
               mask: Any) -> mx.array:
        return quantized_attention(queries, keys, values, scale=scale, mask=mask,
                                   group_size=self.group_size, k_bits=self.k_bits,
                                   v_bits=self.v_bits)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


class AffineKVCache(_Affine):
    """One row's (batch dim 1) affine-quantized keys and values. `offset` is the number of
    tokens held. `update_and_fetch` returns quantized tuples that only `attend` understands."""

    step = STEP

    def __init__(self, k_bits: int = 8, v_bits: int = 8, group_size: int = 64) -> None:
        _check(k_bits, v_bits, group_size)
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.offset = 0
        self.k_bits = k_bits
        self.v_bits = v_bits
        self.group_size = group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        prev = self.offset
        self.keys = _append(self.keys, _quantize(keys, self.group_size, self.k_bits), prev)
        self.values = _append(self.values, _quantize(values, self.group_size, self.v_bits), prev)
        self.offset += keys.shape[2]
        return _upto(self.keys, self.offset), _upto(self.values, self.offset)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self.k_bits, self.v_bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self.k_bits, self.v_bits = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[AffineKVCache]) -> BatchAffineKVCache:
        return BatchAffineKVCache.merge(caches)

    @classmethod
    def from_dense(cls, kv: KVCache, k_bits: int = 8, v_bits: int = 8,
                   group_size: int = 64) -> AffineKVCache:
        """Quantize every token a dense per-row cache holds (the dense cache is left as it was)."""
        cache = cls(k_bits, v_bits, group_size)
        if kv.keys is not None:
            cache.keys = _quantize(kv.keys[..., :kv.offset, :], group_size, k_bits)
            cache.values = _quantize(kv.values[..., :kv.offset, :], group_size, v_bits)
        cache.offset = kv.offset
        return cache


class BatchAffineKVCache(_Affine, LeftPaddedBatch):
    """Rows of AffineKVCache in one left-padded batch, with mlx-lm BatchKVCache's semantics:
    `left_padding` and `offset` are per-row arrays (offset = tokens a row holds), `_idx` is the
    shared write position, and the mask hides each row's left padding."""

    step = STEP

    def __init__(self, left_padding: list[int], k_bits: int = 8, v_bits: int = 8,
                 group_size: int = 64) -> None:
        _check(k_bits, v_bits, group_size)
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.k_bits = k_bits
        self.v_bits = v_bits
        self.group_size = group_size

    def _params(self) -> tuple[int, int, int]:
        return self.k_bits, self.v_bits, self.group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        prev = self._idx
        self.keys = _append(self.keys, _quantize(keys, self.group_size, self.k_bits), prev)
        self.values = _append(self.values, _quantize(values, self.group_size, self.v_bits), prev)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return _upto(self.keys, self._idx), _upto(self.values, self._idx)

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.left_padding, self._idx, self.k_bits,
                self.v_bits, self.group_size)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.left_padding, self._idx, self.k_bits,
         self.v_bits, self.group_size) = v
        self._right_padding = None   # as mlx-lm's BatchKVCache, pending right padding is not kept

    def extend(self, other: BatchAffineKVCache) -> None:
        """Append `other`'s rows after this batch's; both are right-aligned at the larger `_idx`."""
        if other._params() != self._params():
            raise ValueError(f"cannot extend a batch with bits/group {self._params()} by one with "
                             f"{other._params()}")
        width = max(self._idx, other._idx)
        ref = self if self.keys is not None else other

        def aligned(c: BatchAffineKVCache, store: Quantized | None, like: Quantized | None) -> Any:
            rows = c.offset.shape[0]
            if like is None:
                return None
            if store is None:
                return tuple(mx.zeros((rows, x.shape[1], width, x.shape[3]), x.dtype) for x in like)
            pad = [(0, 0), (0, 0), (width - c._idx, 0), (0, 0)]
            return tuple(mx.pad(x[..., :c._idx, :], pad) for x in store)

        parts = [(aligned(c, c.keys, ref.keys), aligned(c, c.values, ref.values))
                 for c in (self, other)]
        if ref.keys is not None:
            self.keys = tuple(mx.concatenate(z, axis=0) for z in zip(parts[0][0], parts[1][0]))
            self.values = tuple(mx.concatenate(z, axis=0) for z in zip(parts[0][1], parts[1][1]))
        self.left_padding = mx.concatenate([self.left_padding + (width - self._idx),
                                            other.left_padding + (width - other._idx)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = width

    def extract(self, i: int, pad: int | None = None) -> AffineKVCache:
        """Row `i` as its own cache (copied, without padding); `pad`: its left padding, when
        the caller has it on the host."""
        cache = AffineKVCache(*self._params())
        pad = self.left_padding.tolist()[i] if pad is None else pad
        if self.keys is not None:
            cache.keys = tuple(mx.contiguous(x[i:i + 1, :, pad:self._idx]) for x in self.keys)
            cache.values = tuple(mx.contiguous(x[i:i + 1, :, pad:self._idx]) for x in self.values)
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: list[AffineKVCache]) -> BatchAffineKVCache:
        """Per-row caches → one batch, each row right-aligned (left-padded)."""
        params = {(c.k_bits, c.v_bits, c.group_size) for c in caches}
        if len(params) != 1:
            raise ValueError(f"cannot merge rows with different bits/group sizes: {sorted(params)}")
        lengths = [c.size() for c in caches]
        width = max(lengths)
        cache = cls([width - n for n in lengths], *params.pop())
        ref = next((c for c in caches if c.keys is not None and c.offset), None)
        if ref is None:
            return cache

        def stacked(pick: Any) -> Quantized:
            out = tuple(mx.zeros((len(caches), x.shape[1], width, x.shape[3]), x.dtype)
                        for x in pick(ref))
            for row, (n, c) in enumerate(zip(lengths, caches)):
                if c.keys is not None and n:
                    for x, y in zip(out, pick(c)):
                        x[row:row + 1, :, width - n:] = y[..., :n, :]
            return out

        cache.keys = stacked(lambda c: c.keys)
        cache.values = stacked(lambda c: c.values)
        cache.offset = cache.offset + width
        cache._idx = width
        return cache

    @classmethod
    def from_dense(cls, batch: BatchKVCache, k_bits: int = 8, v_bits: int = 8,
                   group_size: int = 64) -> BatchAffineKVCache:
        """Quantize every token a dense batch holds, keeping its row layout (padding, `_idx`,
        pending right padding), so masks built by either agree."""
        cache = cls([], k_bits, v_bits, group_size)
        if batch.keys is not None:
            cache.keys = _quantize(batch.keys[..., :batch._idx, :], group_size, k_bits)
            cache.values = _quantize(batch.values[..., :batch._idx, :], group_size, v_bits)
        # new array objects: MLX's `+=` updates an array object in place, and `batch` goes on
        cache.left_padding = batch.left_padding[...]
        cache.offset = batch.offset[...]
        cache._idx = batch._idx
        right = batch._right_padding
        cache._right_padding = None if right is None else right[...]
        return cache
