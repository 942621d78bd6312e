"""Attention dispatch for KV layouts whose attention is not the stock one.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)`, imported by name into each model module. `install()` rebinds that name in
every loaded mlx-lm model module to `dispatch`, which hands the call to the cache when it has an
`attend` method (TurboQuant, mixed-bit, delayed conversion) and to mlx-lm otherwise, so dense,
q4/q8 and recurrent layers keep mlx-lm's exact arithmetic. mlx-vlm's model modules (its own
copy of the function) are rebound too. A KV-shared layer (Gemma 4 E2B / E4B) has no cache and
attends over what its source layer's update_and_fetch returned; a layout's quantized K/V come
`Fetched`, naming the cache that reads them, so the shared layer attends as its source does.
Engine thread, at load.

On CUDA, MLX 0.32 runs attention with more than one query per row through cuDNN graphs cached
by exact shape, key length included: every new (rows, prompt length) pair builds a graph,
which costs far more than the composed form (docs/notes, the measurements behind the code),
and a verify forward (a few queries per row, one more key every
step) would build one every step. With `composed=True` such calls run as plain matmul + softmax
instead whenever their float32 scores fit COMPOSED_MAX_SCORE_BYTES (verify, short and medium
prompt chunks of many rows); long chunks, whose scores would not, keep the fused (flash)
kernel, and so does decode (one query per row) unless `model.composed_decode`. So does one
row's full prompt chunk (`scheduler.prefill_chunk` queries): chunks end on multiples of it, so
its shapes recur in every long prompt and each graph is built once (the kernel warm-up builds
the first two), where the composed form would write up to 512 MiB of scores per layer."""
from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

_stock = base.scaled_dot_product_attention
COMPOSED_MAX_SCORE_BYTES = 512 << 20   # the composed form's float32 scores, at most
composed = False   # set by install(): CUDA with model.composed_attention
composed_decode = False   # set by install(): model.composed_decode (masked decode composed too)
full_chunk = 0   # set by install(): scheduler.prefill_chunk (one row's full chunk stays fused)


def composed_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                       mask: Any) -> mx.array:
    """softmax(q·kᵀ·scale + mask)·v with grouped-query heads, scores in float32.

    A key/value head's query heads and positions are folded into one matrix (B, n_kv, rep·L, D),
    so both matmuls are plain batched GEMMs over the cache's own keys and values. Broadcasting
    the keys across the query heads instead (B, n_kv, 1, …) is the same arithmetic, but MLX's
    CUDA matmul cannot express that batch layout as one strided GEMM: at many padded decode
    rows it was slow and its temporaries filled the device."""
    B, n_q, L, D = queries.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    rep = n_q // n_kv
    q = (queries * scale).reshape(B, n_kv, rep * L, D)
    scores = (q @ keys.swapaxes(-1, -2)).astype(mx.float32).reshape(B, n_kv, rep, L, n_keys)
    if mask is not None:
        if isinstance(mask, str):
            mask = mx.arange(n_keys - L, n_keys)[:, None] >= mx.arange(n_keys)[None]
        elif mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + mask.astype(mx.float32)
    probs = mx.softmax(scores, axis=-1).astype(values.dtype).reshape(B, n_kv, rep * L, n_keys)
    return (probs @ values).reshape(B, n_q, L, values.shape[-1])


def dense_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    mask: Any) -> mx.array:
    """Attention over dense keys/values held outside mlx-lm's caches (a layout that
    dequantizes on CUDA, a row still before its conversion boundary): the composed path where
    `dispatch` would take it, else MLX's fused kernel."""
    if composed and _composable(queries, keys, mask):
        return composed_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _composable(queries: mx.array, keys: mx.array, mask: Any) -> bool:
    """One query per row (decode) keeps MLX's fused kernel unless `composed_decode` and the
    batch is padded (masked): once its cuDNN graphs are built for those key lengths, the fused
    kernel decodes faster than the composed form. So does one row's full prompt chunk (its
    shapes recur; composed, its scores cost several passes over up to 512 MiB).
    Anything else (prompt chunks, verify) is composed while its scores fit the budget."""
    B, n_q, L, _ = queries.shape
    if L == 1 and not (composed_decode and mask is not None):
        return False
    if B == 1 and L == full_chunk:
        return False
    return B * n_q * L * keys.shape[2] * 4 <= COMPOSED_MAX_SCORE_BYTES


class Fetched(tuple):
    """K or V as a layout's cache fetched them (quantized parts, or a batch's dense and
    quantized halves), with `cache`, whose `attend` reads them: a KV-shared layer gets these
    from its source layer and no cache of its own."""

    cache: Any


def tag_fetched(kv: Any, cache: Any) -> Any:
    """`kv` tagged with the cache that reads it; dense arrays need no tag."""
    if not isinstance(kv, (tuple, list)):
        return kv
    out = Fetched(kv)
    out.cache = cache
    return out


def dispatch(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
             sinks: Any = None) -> Any:
    if cache is None and isinstance(keys, Fetched):
        cache = keys.cache   # a KV-shared layer: attend as the source layer's cache does
    attend = getattr(cache, "attend", None)
    if attend is not None:
        if sinks is not None:
            raise ValueError(f"{type(cache).__name__} does not support attention sinks")
        return attend(queries, keys, values, scale=scale, mask=mask)
    if sinks is None and not hasattr(cache, "bits"):
        return dense_attention(queries, keys, values, scale, mask)
    return _stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def install(model: Any = None, composed_on_cuda: bool = False,
            compose_decode: bool = False, prefill_chunk: int = 0) -> int:
    """Route attention through `dispatch` in every imported mlx-lm model module (and the
    module of `model`, if given). Returns how many modules were patched; idempotent."""
    global composed, composed_decode, full_chunk
    composed = composed or (composed_on_cuda and on_cuda())
    composed_decode = compose_decode
    full_chunk = prefill_chunk
    names = [n for n in list(sys.modules) if n.startswith(("mlx_lm.models.", "mlx_vlm.models."))]
    vlm_base = sys.modules.get("mlx_vlm.models.base")   # loaded with a model mlx-vlm serves
    stocks = (_stock, getattr(vlm_base, "scaled_dot_product_attention", _stock))
    if model is not None:
        names.append(type(model).__module__)
    patched = 0
    for name in names:
        module = sys.modules.get(name)
        if module is None or module is base or name == "mlx_vlm.models.base":
            continue
        if getattr(module, "scaled_dot_product_attention", None) in stocks:
            module.scaled_dot_product_attention = dispatch
            patched += 1
    return patched
