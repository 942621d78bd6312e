"""TurboQuant KV layout (`kv=turbo`): keys affine-quantized by mx.quantize; values rotated by a
randomized Hadamard transform, scaled per group by their RMS and Lloyd-Max quantized, indices
packed by bit plane. Per-row and batched caches with mlx-lm's semantics. Engine thread."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask, dynamic_roll

from pipeline.kv.padded import LeftPaddedBatch
from pipeline.kv.quantized import qmatmul

K_BITS = (2, 4, 5, 8)
V_BITS = (2, 3, 4, 5, 8)
GROUP_SIZES = (32, 64, 128)       # what mx.quantize accepts for the keys
V_GROUP_SIZES = (16, 32, 64, 128)
MIN_HEAD_DIM = 16
ROTATION_SEED = 20250417
STEP = 256                        # tokens of capacity added at a time, as mlx-lm's caches
CONVERT_CHUNK = 4096              # tokens encoded per evaluated chunk in from_dense


def check_turbo(head_dim: int, k_bits: int, v_bits: int, group_size: int = 64,
                v_group_size: int = 64) -> None:
    """Raise ValueError naming the bad value and the allowed set."""
    _check_params(k_bits, v_bits, group_size, v_group_size)
    if head_dim < MIN_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim={head_dim} is not supported by kv=turbo: the Hadamard rotation needs a "
            f"power of two >= {MIN_HEAD_DIM} (16, 32, 64, 128, 256, ...); use kv=q8, kv=q4 or "
            f"kv=dense for this model")


def _check_params(k_bits: int, v_bits: int, group_size: int, v_group_size: int) -> None:
    if k_bits not in K_BITS:
        raise ValueError(f"kv.k_bits={k_bits} is not supported by kv=turbo; allowed: {K_BITS}")
    if v_bits not in V_BITS:
        raise ValueError(f"kv.v_bits={v_bits} is not supported by kv=turbo; allowed: {V_BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"kv.group_size={group_size} is not supported by kv=turbo; "
                         f"allowed: {GROUP_SIZES}")
    if v_group_size not in V_GROUP_SIZES:
        raise ValueError(f"kv.v_group_size={v_group_size} is not supported by kv=turbo; "
                         f"allowed: {V_GROUP_SIZES}")


def turbo_bytes_per_token(n_kv_heads: int, head_dim: int, k_bits: int, v_bits: int,
                          group_size: int = 64, v_group_size: int = 64,
                          key_scale_bytes: int = 2) -> int:
    """Exact bytes one token takes in one layer (keys + values, with their scales).
    `key_scale_bytes` is the model dtype's size (mx.quantize keeps scales/biases in it)."""
    check_turbo(head_dim, k_bits, v_bits, group_size, v_group_size)
    kd = _key_dim(head_dim)
    key = kd * k_bits // 8 + kd // _key_group(head_dim, group_size) * 2 * key_scale_bytes
    value = head_dim * v_bits // 8 + head_dim // min(v_group_size, head_dim) * 2
    return n_kv_heads * (key + value)


def _key_dim(head_dim: int) -> int:
    return max(head_dim, 32)   # mx.quantize's smallest group is 32: shorter keys are zero-padded


def _key_group(head_dim: int, group_size: int) -> int:
    return min(group_size, _key_dim(head_dim))


# -- Lloyd-Max codebooks for N(0, 1) ------------------------------------------------------------
_erf = np.frompyfunc(math.erf, 1, 1)


def _cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(x, np.float64) / math.sqrt(2.0)).astype(np.float64))


def _pdf(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _edges(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mids = 0.5 * (levels[1:] + levels[:-1])
    return np.concatenate([[-np.inf], mids]), np.concatenate([mids, [np.inf]])


@lru_cache(maxsize=None)
def lloyd_max(bits: int) -> np.ndarray:
    """The 2**bits reconstruction levels minimising E[(X - Q(X))^2] for X ~ N(0, 1), by Lloyd
    iterations from the high-rate optimum (quantiles of N(0, 3)); float64, ascending."""
    n = 1 << bits
    p = (np.arange(n) + 0.5) / n
    lo, hi = np.full(n, -12.0), np.full(n, 12.0)
    for _ in range(60):   # N(0,1) quantiles by bisection: numpy has no inverse erf
        mid = 0.5 * (lo + hi)
        below = _cdf(mid) < p
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    levels = math.sqrt(3.0) * 0.5 * (lo + hi)
    for _ in range(4000):   # 8 bits converges slowly; 4000 steps leave it within 1e-4 relative
        a, b = _edges(levels)
        new = (_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a))
        done = np.max(np.abs(new - levels)) < 1e-9
        levels = new
        if done:
            break
    return levels


def gaussian_distortion(bits: int) -> float:
    """E[(X - Q(X))^2] of `lloyd_max(bits)` for X ~ N(0, 1), in closed form per cell."""
    levels = lloyd_max(bits)
    a, b = _edges(levels)
    mass = _cdf(b) - _cdf(a)
    first = _pdf(a) - _pdf(b)
    a_pdf = np.where(np.isinf(a), 0.0, np.nan_to_num(a) * _pdf(a))
    b_pdf = np.where(np.isinf(b), 0.0, np.nan_to_num(b) * _pdf(b))
    second = mass + a_pdf - b_pdf
    return float(np.sum(second - 2.0 * levels * first + levels * levels * mass))


@lru_cache(maxsize=None)
def _codebook(bits: int) -> tuple[mx.array, mx.array]:
    levels = lloyd_max(bits)
    return mx.array(levels, dtype=mx.float32), mx.array(_edges(levels)[1][:-1], dtype=mx.float32)


# -- rotation --------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _signs(head_dim: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.choice(np.array([-1.0, 1.0], np.float32), size=head_dim))


def rotation_matrix(head_dim: int, seed: int = ROTATION_SEED) -> mx.array:
    """R = H_d · diag(s) / sqrt(d) (Sylvester Hadamard, random signs), float32. Values are stored
    as v @ R and the attention output comes back as out_rot @ R^T."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / math.sqrt(head_dim)) * _signs(head_dim, seed)[None, :]


def rotate(x: mx.array, seed: int = ROTATION_SEED) -> mx.array:
    """x @ R along the last axis, by the fast Walsh-Hadamard transform."""
    d = x.shape[-1]
    return mx.hadamard_transform(x, scale=1.0 / math.sqrt(d)) * _signs(d, seed).astype(x.dtype)


def unrotate(y: mx.array, seed: int = ROTATION_SEED) -> mx.array:
    """y @ R^T along the last axis (the inverse of `rotate`)."""
    d = y.shape[-1]
    return mx.hadamard_transform(y * _signs(d, seed).astype(y.dtype), scale=1.0 / math.sqrt(d))


# -- bit-plane packing -----------------------------------------------------------------------
_WORD = {16: mx.uint16, 32: mx.uint32}


def pack_bits(idx: mx.array, bits: int) -> mx.array:
    """(..., n) integer indices < 2**bits → (..., bits * n / w) words of w = min(32, n) bits:
    for each run of w values, one word per bit plane, value j in bit j of its word."""
    n = idx.shape[-1]
    w = min(32, n)
    x = idx.astype(mx.uint32).reshape(*idx.shape[:-1], 1, n // w, w)
    planes = (x >> mx.arange(bits, dtype=mx.uint32)[:, None, None]) & 1
    words = mx.sum(planes << mx.arange(w, dtype=mx.uint32), axis=-1)
    return words.reshape(*idx.shape[:-1], bits * (n // w)).astype(_WORD[w])


def unpack_bits(words: mx.array, bits: int, n: int) -> mx.array:
    """The inverse of `pack_bits`: (..., bits * n / w) words → (..., n) uint32 indices."""
    w = min(32, n)
    x = words.astype(mx.uint32).reshape(*words.shape[:-1], bits, n // w, 1)
    shifts = mx.arange(w, dtype=mx.uint32)
    idx = (x[..., 0, :, :] >> shifts) & 1
    for j in range(1, bits):   # one plane at a time: temporaries stay the size of the result
        idx = idx | (((x[..., j, :, :] >> shifts) & 1) << j)
    return idx.reshape(*words.shape[:-1], n)


# -- codecs ----------------------------------------------------------------------------------
def encode_values(v: mx.array, bits: int, group: int = 64,
                  seed: int = ROTATION_SEED) -> tuple[mx.array, mx.array]:
    """(..., d) values → (packed indices, float16 RMS scale per group of the rotated vector)."""
    d = v.shape[-1]
    g = min(group, d)
    x = rotate(v.astype(mx.float32), seed).reshape(*v.shape[:-1], d // g, g)
    scales = mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True)).astype(mx.float16)
    s = scales.astype(mx.float32)
    u = mx.where(s > 0, x / mx.where(s > 0, s, 1.0), 0.0)
    idx = mx.searchsorted(_codebook(bits)[1], u.reshape(v.shape))
    return pack_bits(idx, bits), scales.squeeze(-1)


def decode_values(packed: mx.array, scales: mx.array, bits: int, head_dim: int,
                  dtype: mx.Dtype = mx.float32) -> mx.array:
    """Values in the rotated basis (v @ R, up to quantization error), (..., head_dim)."""
    g = head_dim // scales.shape[-1]
    x = mx.take(_codebook(bits)[0], unpack_bits(packed, bits, head_dim))
    x = x.reshape(*scales.shape, g) * scales[..., None].astype(mx.float32)
    return x.reshape(*packed.shape[:-1], head_dim).astype(dtype)


def encode_keys(k: mx.array, bits: int, group_size: int = 64) -> tuple[mx.array, ...]:
    d = k.shape[-1]
    if d < _key_dim(d):
        k = mx.pad(k, [(0, 0)] * (k.ndim - 1) + [(0, _key_dim(d) - d)])
    return tuple(mx.quantize(k, group_size=_key_group(d, group_size), bits=bits))


def turbo_attention(queries: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...],
                    *, scale: float, mask: Any, k_bits: int, v_bits: int, group_size: int,
                    seed: int = ROTATION_SEED) -> mx.array:
    """softmax(q·k_quant^T · scale + mask) @ v_rot, rotated back once per query; GQA by
    grouping the query heads over each KV head. keys/values as the caches return them."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[1]
    rep = n_q_heads // n_kv_heads
    q = queries * scale
    if D < _key_dim(D):
        q = mx.pad(q, [(0, 0)] * 3 + [(0, _key_dim(D) - D)])
    q = q.reshape(B, n_kv_heads, rep, L, q.shape[-1])
    k = tuple(mx.expand_dims(a, -3) for a in keys)
    scores = qmatmul(q, *k, transpose=True, group_size=_key_group(D, group_size), bits=k_bits)
    if mask is not None:
        if isinstance(mask, str):
            n_keys = scores.shape[-1]
            mask = mx.arange(n_keys - L, n_keys)[:, None] >= mx.arange(n_keys)[None]
        elif mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    v = decode_values(*values, v_bits, D, queries.dtype)
    out = unrotate(probs @ mx.expand_dims(v, -3), seed)
    return out.reshape(B, n_q_heads, L, D)


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
        """Attention over what update_and_fetch returned (pipeline.kv.attention.dispatch)."""
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

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's padding to the left."""
        if self._right_padding is None:
            return
        pad = self._right_padding[:, None]
        if self.keys is not None:
            self.keys = tuple(dynamic_roll(p, pad, axis=2) for p in self.keys)
            self.values = tuple(dynamic_roll(p, pad, axis=2) for p in self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

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

    def extract(self, idx: int) -> TurboKVCache:
        """Row `idx` as its own per-row cache (padding dropped, arrays copied)."""
        cache = TurboKVCache(**self.params)
        pad = self.left_padding.tolist()[idx]
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
