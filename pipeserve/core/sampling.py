"""The distribution a T > 0 row samples from: mlx-lm's truncation filters (top_p, min_p, XTC,
top_k) and temperature, as plain MLX functions of one row's logprobs (no mx.compile: compiled,
every distinct value a client sends would be a new graph, kept for the process). Engine
thread (the sample stage)."""
from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from pipeserve.request import SamplingParams


def sampling_logits(logprobs: mx.array, sp: SamplingParams, eos_ids: list[int]) -> mx.array:
    """The logits a T > 0 row samples from: mlx-lm's truncation order (top_p, min_p, XTC,
    top_k), then temperature. XTC (with probability p, drop every token above the threshold
    but the least likely of them) enters as its exact mixture, log((1 - p) * plain + p * cut),
    so the draw needs no second random number and a verify forward gets the same distribution
    as one-token sampling."""
    lp = logprobs
    if sp.top_p < 1.0:
        lp = top_p(lp, sp.top_p)
    if sp.min_p > 0:
        lp = min_p(lp, sp.min_p)
    vocab = lp.shape[-1]
    k = sp.top_k if 0 < sp.top_k < vocab else 0   # k >= vocab keeps every token
    scale = 1 / sp.temperature
    # a cold row: relative to the best token, which stays 0 however large 1/T is (in float16,
    # the best token's logprob times 1/T would overflow to -inf from about T < 2e-4)
    best = mx.max(lp, axis=-1, keepdims=True) if scale > 100 else 0.0
    scaled = (top_k(lp, k) - best) * scale
    if sp.xtc_probability <= 0:
        return scaled
    cut = (top_k(xtc_cut(lp, sp.xtc_threshold, eos_ids), k) - best) * scale
    p = sp.xtc_probability
    return mx.log((1 - p) * mx.softmax(scaled, axis=-1) + p * mx.softmax(cut, axis=-1))


# The filters below are mlx-lm's (sample_utils), uncompiled.
_NEG_INF = -float("inf")


def top_p(lp: mx.array, p: float) -> mx.array:
    sorted_lp = mx.sort(lp, axis=-1)
    sorted_p = mx.exp(sorted_lp.astype(mx.float32))
    mass_above = mx.cumsum(sorted_p, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + sorted_p[..., :1]
    # at least the best token stays (top_p 0 keeps just it)
    num_dropped = mx.minimum((mass_above >= p * total).sum(axis=-1, keepdims=True),
                             lp.shape[-1] - 1)
    threshold = mx.take_along_axis(sorted_lp, num_dropped, axis=-1)
    return mx.where(lp < threshold, _NEG_INF, lp)


def min_p(lp: mx.array, p: float) -> mx.array:
    floor = mx.max(lp, axis=-1, keepdims=True) + math.log(p)
    return mx.where(lp < floor, _NEG_INF, lp)


def xtc_cut(lp: mx.array, threshold: float, eos_ids: list[int]) -> mx.array:
    """XTC's cut: tokens more likely than the least likely token above `threshold` go (stop
    tokens never do); with fewer than two tokens above it, nothing goes."""
    probs = mx.exp(lp)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > least
    if eos_ids:
        mask = mask & _can_cut(tuple(eos_ids), lp.shape[-1])
    return mx.where(mask, _NEG_INF, lp)


@functools.lru_cache(maxsize=4)
def _can_cut(eos_ids: tuple[int, ...], vocab: int) -> mx.array:
    keep = np.ones(vocab, dtype=np.bool_)
    keep[[t for t in eos_ids if t < vocab]] = False
    return mx.array(keep)


def top_k(lp: mx.array, k: int) -> mx.array:
    if not k:
        return lp
    drop = mx.argpartition(-lp, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(lp, drop, mx.array(_NEG_INF, lp.dtype), axis=-1)
