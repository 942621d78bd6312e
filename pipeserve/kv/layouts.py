"""KV layouts (SPEC §7): one object per served model that makes each row's per-layer caches.

Every layout hands out cache objects with mlx-lm's cache interface (update_and_fetch, trim,
size, nbytes, state, merge/extend/filter/extract for the shared decode batch), so the
scheduler, the prompt cache, the SSD tier and checkpoints never branch on the scheme. Only the
full-attention layers change: sliding-window layers stay dense (one warning at launch) and
recurrent state is never quantized. Built on the engine thread at load."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from pipeserve.config import KvConfig, build
from pipeserve.errors import ConfigError
from pipeserve.kv.delayed import DelayedKVCache
from pipeserve.kv.paged import BlockPool, PagedKVCache
from pipeserve.kv.quantized import AffineKVCache
from pipeserve.kv.turbo import TurboKVCache, check_turbo, turbo_bytes_per_token
from pipeserve.memory import device_memory_bytes

log = logging.getLogger("pipeserve")

QUANT_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class AttentionLayer:
    index: int          # position in the model's cache list
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int


def attention_layers(model: Any) -> tuple[list[AttentionLayer], int]:
    """The model's full-attention layers (dense KVCache in mlx-lm's cache list) with their
    shapes, learnt by building one token's forward (never evaluated: shapes are known without
    it, and a lazily built model's weights stay unread); and how many sliding-window layers."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    layers, sliding = [], 0
    for i, c in enumerate(cache):
        if type(c) is KVCache and c.keys is not None:
            _, h, _, d = c.keys.shape
            layers.append(AttentionLayer(i, h, d, c.keys.dtype.size))
        elif isinstance(c, RotatingKVCache):
            sliding += 1
    return layers, sliding


class DenseLayout:
    """kv=dense: mlx-lm's own caches, untouched (the reference every layout is tested against)."""

    grouped_prefill = True   # prompts of similar length may share one padded prefill forward
    quantizes = False        # full-attention layers convert to quantized KV
    own_attention = False    # its caches need pipeserve's attention (pipeserve/kv/attention.py)
    # on_convert(rows): rows' caches converted to the quantized layout, in shares of a row (one
    # layer cache of a row is 1 / its converting layers); set by build_layout
    on_convert: Callable[[float], None] | None = None

    def __init__(self, cfg: KvConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.layers: dict[int, AttentionLayer] = {}

    def prepare(self, model: Any) -> None:
        """At load: learn the attention layers, refuse what cannot work, warn once."""
        layers, sliding = attention_layers(model)
        self.layers = {a.index: a for a in layers}
        if sliding and self.quantizes:
            log.warning("kv=%s: %d sliding-window layer(s) stay dense; only the %d "
                        "full-attention layer(s) use the %s layout", self.name, sliding,
                        len(layers), self.name)
        self.check()

    def check(self) -> None:
        pass

    @property
    def identity(self) -> str:
        """The effective scheme, part of every prompt-cache and checkpoint key."""
        return "kv=dense"

    def make_cache(self, model: Any) -> list[Any]:
        caches = make_prompt_cache(model)
        return [self.layer_cache(i, c) if i in self.layers else c for i, c in enumerate(caches)]

    def layer_cache(self, index: int, dense: KVCache) -> Any:
        return dense

    def adopt(self, caches: list[Any]) -> list[Any]:
        """Caches restored from the SSD tier or a checkpoint, in this layout's own form."""
        return caches

    def attach(self, prompt_cache: Any) -> None:
        """Called once the prompt cache exists (None with cache=off)."""

    @property
    def pool_bytes(self) -> int | None:
        """Bytes of KV the layout can hold at most (a paged pool), or None (unbounded)."""
        return None

    def bytes_per_token(self, layer: AttentionLayer) -> float:
        """Bytes one token of one row occupies in this layer (after conversion)."""
        return 2 * layer.n_kv_heads * layer.head_dim * layer.dtype_bytes

    def stats(self) -> dict[str, int]:
        """Layout-specific gauges (paged pool blocks); empty for the others."""
        return {}


def _affine_bytes(layer: AttentionLayer, k_bits: int, v_bits: int, group: int) -> float:
    n = layer.n_kv_heads * layer.head_dim
    per_group = 2 * layer.dtype_bytes / group   # scale + bias per group, in the keys' dtype
    return n * (k_bits / 8 + per_group) + n * (v_bits / 8 + per_group)


class _Converting(DenseLayout, ABC):
    """Layouts that quantize: rows stay dense until `quantized_start` tokens, then convert."""

    grouped_prefill = False
    own_attention = True
    quantizes = True

    @abstractmethod
    def target(self, index: int) -> tuple[type | None, dict[str, Any]]:
        """The cache class (None: keep the layer dense) and its parameters for one layer."""

    def prepare(self, model: Any) -> None:
        super().prepare(model)
        self.converting = sum(self.target(i)[0] is not None for i in self.layers)

    def layer_cache(self, index: int, dense: KVCache) -> Any:
        cls, params = self.target(index)
        if cls is None:
            return dense
        # even at quantized_start=0 the first forward attends densely and converts after it,
        # which is exactly mlx-lm's quantized_kv_start timing (and its results)
        return DelayedKVCache(getattr(self.cfg, "quantized_start", 0), cls,
                              on_convert=self._converted, **params)

    def adopt(self, caches: list[Any]) -> list[Any]:
        """Restored rows report their conversions too (a callback is not part of `state`)."""
        for c in caches:
            if isinstance(c, DelayedKVCache):
                c.on_convert = self._converted
        return caches

    def _converted(self, num_tokens: int) -> None:
        """One layer cache of a row converted: that share of a row."""
        if self.on_convert is not None:
            self.on_convert(1 / max(1, self.converting))

    def check(self) -> None:
        group = getattr(self, "group", None) or getattr(self.cfg, "group_size", 64)
        for a in self.layers.values():
            if a.head_dim % group:
                raise ConfigError(
                    f"kv={self.name} cannot quantize layer {a.index}: head_dim {a.head_dim} is "
                    f"not a multiple of the quantization group ({group}; kv.group_size may be "
                    "32, 64 or 128); use a smaller kv.group_size, kv=turbo, kv=dense or kv=paged")


class QuantizedLayout(_Converting):
    """kv=q4 / kv=q8: mlx-lm's affine KV quantization, group 64, same attention arithmetic."""

    def target(self, index: int) -> tuple[type, dict[str, Any]]:
        bits = self.cfg.bits
        return AffineKVCache, {"k_bits": bits, "v_bits": bits, "group_size": self.cfg.group_size}

    @property
    def identity(self) -> str:
        c = self.cfg
        return f"kv=q{c.bits}:g{c.group_size}:start{c.quantized_start}"

    def bytes_per_token(self, layer: AttentionLayer) -> float:
        return _affine_bytes(layer, self.cfg.bits, self.cfg.bits, self.cfg.group_size)


class TurboLayout(_Converting):
    """kv=turbo: affine keys, Hadamard-rotated Lloyd-Max values (full-attention layers)."""

    def check(self) -> None:
        for a in self.layers.values():
            try:
                check_turbo(a.head_dim, self.cfg.k_bits, self.cfg.v_bits)
            except ValueError as e:
                raise ConfigError(f"kv=turbo cannot serve layer {a.index}: {e}") from e

    def target(self, index: int) -> tuple[type, dict[str, Any]]:
        c = self.cfg
        return TurboKVCache, {"k_bits": c.k_bits, "v_bits": c.v_bits, "group_size": c.group_size}

    @property
    def identity(self) -> str:
        c = self.cfg
        return f"kv=turbo:k{c.k_bits}v{c.v_bits}:g{c.group_size}:start{c.quantized_start}"

    def bytes_per_token(self, layer: AttentionLayer) -> float:
        c = self.cfg
        return turbo_bytes_per_token(layer.n_kv_heads, layer.head_dim, c.k_bits, c.v_bits,
                                     c.group_size)


@dataclass(frozen=True)
class LayerBits:
    k_bits: int | None   # None: dense
    v_bits: int | None


def load_kv_config(path: str, layer_indices: list[int]) -> tuple[int, dict[int, LayerBits]]:
    """Parse and validate a kv_config.json; errors name the file, the layer and the value.

    Format: {"group_size": 64, "default": {"k_bits": 8, "v_bits": 8},
             "layers": {"0": "dense", "5": {"k_bits": 8, "v_bits": 4}}}
    Layer numbers count the model's full-attention layers in the cache list's numbering
    (the index of the layer in the model); "dense" keeps a layer unquantized."""
    where = f"kv.config_path={path}"
    try:
        raw = json.loads(Path(path).expanduser().read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be an object")
    unknown = set(raw) - {"group_size", "default", "layers"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; "
                          "allowed: group_size, default, layers")
    group = raw.get("group_size", 64)
    if group not in (32, 64, 128):
        raise ConfigError(f"{where}: group_size must be 32, 64 or 128, got {group!r}")

    def bits(value: Any, what: str) -> LayerBits:
        if value == "dense":
            return LayerBits(None, None)
        if not isinstance(value, dict) or set(value) - {"k_bits", "v_bits"} \
                or "k_bits" not in value or "v_bits" not in value:
            raise ConfigError(f"{where}: {what} must be \"dense\" or "
                              f"{{\"k_bits\": b, \"v_bits\": b}}, got {value!r}")
        for side in ("k_bits", "v_bits"):
            if value[side] not in QUANT_BITS:
                raise ConfigError(f"{where}: {what} {side}={value[side]!r} is not one of "
                                  f"{', '.join(map(str, QUANT_BITS))}")
        return LayerBits(value["k_bits"], value["v_bits"])

    default = bits(raw.get("default", "dense"), "default")
    layers = raw.get("layers", {})
    if not isinstance(layers, dict):
        raise ConfigError(f"{where}: layers must be an object of layer number → bits")
    table = {i: default for i in layer_indices}
    for key, value in layers.items():
        try:
            index = int(key)
        except ValueError:
            raise ConfigError(f"{where}: layer {key!r} is not a layer number") from None
        if index not in table:
            raise ConfigError(f"{where}: layer {index} is not a full-attention layer of this "
                              f"model (full-attention layers: {layer_indices})")
        table[index] = bits(value, f"layer {index}")
    return group, table


class MixedLayout(_Converting):
    """kv=mixed: per-layer key/value bits from kv_config.json."""

    group: int | None = None   # kv_config.json's group_size (read by check)

    def check(self) -> None:
        self.group, self.table = load_kv_config(self.cfg.config_path, sorted(self.layers))
        super().check()
        log.info("kv=mixed: %s", ", ".join(
            f"L{i}:{'dense' if b.k_bits is None else f'k{b.k_bits}v{b.v_bits}'}"
            for i, b in sorted(self.table.items())))

    def target(self, index: int) -> tuple[type | None, dict[str, Any]]:
        b = self.table[index]
        if b.k_bits is None:
            return None, {}
        return AffineKVCache, {"k_bits": b.k_bits, "v_bits": b.v_bits, "group_size": self.group}

    @property
    def identity(self) -> str:
        spec = ",".join(f"{i}:{b.k_bits}/{b.v_bits}" for i, b in sorted(self.table.items()))
        return f"kv=mixed:g{self.group}:start{self.cfg.quantized_start}:{spec}"

    def bytes_per_token(self, layer: AttentionLayer) -> float:
        b = self.table[layer.index]
        if b.k_bits is None:
            return super().bytes_per_token(layer)
        return _affine_bytes(layer, b.k_bits, b.v_bits, self.group)


class PagedLayout(DenseLayout):
    """kv=paged: each full-attention layer's KV lives in a pool of fixed-size blocks; a row
    holds a block table. Rows lent the same cached prefix share its blocks (copy-on-write at
    the first divergent block), so the prompt cache and the running rows are one pool."""

    grouped_prefill = False
    own_attention = True

    def prepare(self, model: Any) -> None:
        super().prepare(model)
        c = self.cfg
        if c.pool_blocks is not None:
            blocks = c.pool_blocks
        else:
            per_block = sum(c.block_size * self.bytes_per_token(a) for a in self.layers.values())
            if c.pool_gb is not None:
                total = c.pool_gb * 2**30
            else:   # default: half of what the device can hold next to nothing else
                total = device_memory_bytes() * 0.5
            blocks = max(1, int(total // max(per_block, 1)))
        self.num_blocks = blocks
        self.pools = {i: BlockPool(c.block_size, blocks) for i in self.layers}
        log.info("kv=paged: %d blocks of %d tokens per layer (%.2f GiB over %d layers)",
                 blocks, c.block_size, blocks * c.block_size * sum(
                     self.bytes_per_token(a) for a in self.layers.values()) / 2**30,
                 len(self.layers))

    @property
    def identity(self) -> str:
        return "kv=dense"   # blocks gather to exactly dense KV: stored entries are dense

    def layer_cache(self, index: int, dense: KVCache) -> Any:
        return PagedKVCache(self.pools[index])

    def attach(self, prompt_cache: Any) -> None:
        """Cached prefixes live in the pool too: when a write needs blocks the pool lacks,
        least recently used prompt-cache entries give theirs back first."""
        if prompt_cache is not None:
            for pool in self.pools.values():
                pool.reclaim = prompt_cache.evict_oldest

    @property
    def pool_bytes(self) -> int:
        return int(self.num_blocks * self.cfg.block_size *
                   sum(self.bytes_per_token(a) for a in self.layers.values()))

    def adopt(self, caches: list[Any]) -> list[Any]:
        return [PagedKVCache.from_portable(c, self.pools[i]) if type(c) is KVCache else c
                for i, c in enumerate(caches)]

    def stats(self) -> dict[str, int]:
        out = {"used": 0, "free": 0, "shared": 0}
        for pool in self.pools.values():
            for k, v in pool.stats().items():
                out[k.removeprefix("blocks_")] += v
        return out


def build_layout(cfg: KvConfig, model: Any,
                 on_convert: Callable[[float], None] | None = None) -> DenseLayout:
    """The layout `cfg` names, prepared for `model`. `on_convert(rows)` is called as rows
    convert to a quantized layout (see DenseLayout.on_convert; the calls for one row add up
    to 1), for every row whose caches the layout makes or adopts."""
    layout = build(cfg._target_, cfg)
    layout.on_convert = on_convert
    layout.prepare(model)
    return layout
