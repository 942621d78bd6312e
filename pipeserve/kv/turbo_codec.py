"""TurboQuant codec: Lloyd-Max codebooks for a Gaussian, the randomized Hadamard rotation,
bit-plane packing, key/value encoding and attention over the encoded cache (used by the
caches in pipeserve/kv/turbo.py). Engine thread."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from pipeserve.kv.attention import dense_attention, on_cuda
from pipeserve.kv.quantized import qmatmul

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
    if on_cuda() and D == _key_dim(D):
        # CUDA (no quantized_matmul kernel for these shapes): dense keys and rotated values
        # through the dense attention, one transient copy of each, rotated back once.
        k = mx.dequantize(*keys, group_size=_key_group(D, group_size), bits=k_bits)
        v = decode_values(*values, v_bits, D, queries.dtype)
        return unrotate(dense_attention(queries, k.astype(queries.dtype), v, scale, mask), seed)
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
