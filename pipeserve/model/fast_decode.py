"""A decode step's forward with each layer's Python collapsed into two compiled calls.

Building a step's graph in Python costs about 150 µs a layer on mlx-lm's modules (each
Linear, norm and reshape a Python call), 4 ms a step for a 28-layer model on a 2-core CPU.
A single stream's step is bounded by that host time where the device is quick (a 0.6B model
on an H100: 3.1 ms a step). Here every layer runs as: compiled(norm, q/k/v projections, q/k
norms, RoPE) → the row's own KVCache update → attention (the module's own function) →
compiled(o projection, residual, norm, MLP, residual); the final norm and head are one more
compiled call. The primitives are mlx-lm's own, in its order: no new fusion (the only
elementwise chain, SwiGLU, is compiled in mlx-lm already), so the logits are the same bits.

Only where that holds by construction: mlx-lm's qwen3 and llama (no sliding window) modules,
every leaf a stock Linear / QuantizedLinear / RMSNorm / RoPE, one new token a row over plain
caches (one row's KVCache, or a batch's BatchKVCache: its per-row offsets and left-padding mask
as mlx-lm's forward passes them), and no LoRA adapter mounted. Anything else runs mlx-lm's
forward. A batch size is traced (about 15 ms on a 2-core CPU for 28 layers) the first time it
decodes two steps in a row, so a burst whose batch grows every step does not trace each size.
The compiled calls keep the modules they were traced with: mounting an adapter later wraps the
Linear layers, so the engine checks for mounted adapters each step (Forward._run)."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import BatchKVCache, KVCache

# model class → its block, attention and MLP classes (the stock ones only), and the digest of
# the forward code replicated here (the five __call__s): another mlx-lm whose code differs runs
# its own forward until this file is checked against it (tests/core/test_fast_decode.py fails)
_FAMILIES: dict[type, tuple[type, type, type, str]] = {
    qwen3.Model: (qwen3.TransformerBlock, qwen3.Attention, qwen3.MLP, "a32b957bb6899e82"),
    llama.Model: (llama.TransformerBlock, llama.Attention, llama.MLP, "18241225bf62630d"),
}
_PROJECTIONS = (nn.Linear, nn.QuantizedLinear)
log = logging.getLogger(__name__)


class FastDecode:
    """Call with (tokens (B, 1), caches) → logits (B, 1, vocab), as `model(tokens, cache=...)`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        self.calls = 0   # steps that ran here (tests: the path was taken)
        self.batches: set[int] = set()   # batch sizes (BatchKVCache) compiled so far
        self._last = 0                    # the previous batch step's size
        self._failed: set[int] = set()    # sizes whose tracing raised (never tried again)
        self._parts = [_compiled(layer) for layer in self.layers]
        self._head = mx.compile(_head(model))
        # the attention function the stock module calls: mlx-lm's, or the one pipeserve's
        # attention dispatch installed there (pipeserve/kv/attention.py), looked up per call
        self._module = sys.modules[type(self.layers[0].self_attn).__module__]
        self._mask_layer = getattr(model.model, "fa_idx", 0)   # llama: its full-attention layer's

    def trace(self, rows: int = 1, offsets: mx.array | None = None) -> None:
        """Each compiled call once, at a decode step's shapes and dtypes (lazy stand-ins: one
        row's scalar offset, or a batch's per-row offsets)."""
        h = self.model.model.embed_tokens(mx.zeros((rows, 1), dtype=mx.uint32))
        at = mx.array(0, dtype=mx.int32) if offsets is None else mx.zeros_like(offsets)
        for pre, post, _ in self._parts:
            q, _, _ = pre(h, at)
            h = post(h, q)   # the attention's output has the queries' shape and dtype
        self._head(h)

    def fits(self, tokens: mx.array, caches: list[Any]) -> bool:
        rows, width = tokens.shape
        if width != 1 or len(caches) != len(self.layers):
            return False
        kind = type(caches[0])
        if kind is KVCache:
            return rows == 1 and all(type(c) is KVCache for c in caches)
        if kind is not BatchKVCache or not all(type(c) is BatchKVCache for c in caches):
            return False
        if rows not in self.batches:   # a new size: traced once it decodes a second step
            last, self._last = self._last, rows
            if rows != last or rows in self._failed:
                return False
            try:   # before the step touches any KV, as at load
                self.trace(rows, caches[0].offset)
            except Exception:
                log.exception("model.fast_decode: tracing a batch of %d rows failed; mlx-lm's "
                              "forward runs for it", rows)
                self._failed.add(rows)
                return False
            self.batches.add(rows)
        self._last = rows
        return True

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        self.calls += 1
        attend = self._module.scaled_dot_product_attention
        h = self.model.model.embed_tokens(tokens)
        batch = type(caches[0]) is BatchKVCache   # per-row offsets (arrays), a padding mask
        mask = self._module.create_attention_mask(h, caches[self._mask_layer]) if batch else None
        offsets: dict[int, mx.array] = {}
        for (pre, post, scale), c in zip(self._parts, caches):
            at = c.offset if batch else offsets.get(c.offset)
            if at is None:   # one row's: every layer's, in a plain model: one array a step
                at = offsets[c.offset] = mx.array(c.offset, dtype=mx.int32)
            q, k, v = pre(h, at)
            k, v = c.update_and_fetch(k, v)
            h = post(h, attend(q, k, v, cache=c, scale=scale, mask=mask))
        return self._head(h)


def fast_decode(model: Any) -> FastDecode | None:
    """The fast decode for this model, or None where it would not compute the same thing."""
    family = _FAMILIES.get(type(model))
    if family is None:
        return None
    block, attention, mlp, digest = family
    inner = model.model
    if _digest(type(model), type(inner), block, attention, mlp) != digest:
        log.info("model.fast_decode: mlx-lm %s's %s forward is not the one it replicates; "
                 "mlx-lm's own runs", _version(), type(model).__module__)
        return None
    if getattr(inner, "swa_idx", None) is not None:   # llama with sliding-window layers
        return None
    for layer in inner.layers:
        at = layer.self_attn
        if type(layer) is not block or type(at) is not attention or type(layer.mlp) is not mlp:
            return None
        leaves = [at.q_proj, at.k_proj, at.v_proj, at.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attention is qwen3.Attention:
            norms += [at.q_norm, at.k_norm]
        if (any(type(m) not in _PROJECTIONS for m in leaves)
                or any(type(m) is not nn.RMSNorm for m in norms) or type(at.rope) is not nn.RoPE):
            return None
    if type(inner.norm) is not nn.RMSNorm:
        return None
    fast = FastDecode(model)
    try:   # trace every compiled call now, on lazy stand-ins (nothing is evaluated): a call
        fast.trace()   # that cannot compile must fail here, not halfway through a step's KV
    except Exception:
        log.exception("model.fast_decode: tracing the compiled decode failed; mlx-lm's "
                      "forward runs")
        return None
    return fast


@functools.cache
def _digest(*classes: type) -> str:
    try:
        source = "".join(inspect.getsource(c.__call__) for c in classes)
    except (OSError, TypeError):   # no source to read (an install without .py files)
        return ""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _version() -> str:
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _compiled(layer: Any) -> tuple[Callable[..., Any], Callable[..., Any], float]:
    """The layer's work before its KV update and after its attention, each one compiled call,
    written as the stock block and attention write it."""
    at = layer.self_attn
    q_norm = getattr(at, "q_norm", None)   # qwen3's per-head norms; llama has none
    k_norm = getattr(at, "k_norm", None)

    def pre(x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        h = layer.input_layernorm(x)
        queries, keys, values = at.q_proj(h), at.k_proj(h), at.v_proj(h)
        queries = queries.reshape(B, L, at.n_heads, -1)
        keys = keys.reshape(B, L, at.n_kv_heads, -1)
        if q_norm is not None:
            queries, keys = q_norm(queries), k_norm(keys)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = values.reshape(B, L, at.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return at.rope(queries, offset=offset), at.rope(keys, offset=offset), values

    def post(x: mx.array, output: mx.array) -> mx.array:
        B, _, L, _ = output.shape
        h = x + at.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return mx.compile(pre), mx.compile(post), at.scale


def _head(model: Any) -> Callable[[mx.array], mx.array]:
    inner = model.model

    def head(h: mx.array) -> mx.array:
        h = inner.norm(h)
        if model.args.tie_word_embeddings:
            return inner.embed_tokens.as_linear(h)
        return model.lm_head(h)

    return head
