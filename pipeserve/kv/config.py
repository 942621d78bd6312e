"""The `kv` config group (SPEC §3, §7): one schema per KV layout option, each declared once
by `@register` (pipeserve/registry.py); its `_target_` names the layout class. Launch time,
main thread; no mlx import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from pipeserve.errors import ConfigError, check_positive as _positive
from pipeserve.registry import name_of, register


TURBO_K_BITS = (2, 4, 5, 8)
TURBO_V_BITS = (2, 3, 4, 5, 8)


@dataclass
class KvConfig:
    """The KV layout of full-attention layers (SPEC §7). Recurrent state is never quantized;
    sliding-window layers stay dense under every quantized layout."""

    _target_: str = MISSING

    @property
    def name(self) -> str:
        """The option (`kv=<name>`): the metric label, the name in logs and messages."""
        return name_of(self)

    def __post_init__(self) -> None:
        pass


@register("kv", "dense")
@dataclass
class DenseKvConfig(KvConfig):
    _target_: str = "pipeserve.kv.layouts.DenseLayout"


def _check_start(name: str, start: int) -> None:
    if start < 0:
        raise ConfigError(f"kv.quantized_start must be >= 0 tokens, got {start} (kv={name})")


def _check_group(group_size: int) -> None:
    if group_size not in (32, 64, 128):
        raise ConfigError(f"kv.group_size must be one of 32, 64, 128, got {group_size}")


@register("kv", "q4", "q8")
@dataclass
class QuantizedKvConfig(KvConfig):
    """Uniform affine quantization (mlx-lm's QuantizedKVCache scheme)."""

    _target_: str = "pipeserve.kv.layouts.QuantizedLayout"
    bits: int = 8              # key and value bits: 4 (kv=q4) or 8 (kv=q8)
    group_size: int = 64       # elements sharing one scale and bias: 32, 64 or 128
    quantized_start: int = 0   # tokens a row keeps dense before it converts

    @property
    def name(self) -> str:
        return f"q{self.bits}"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"kv.bits must be 4 or 8 (kv=q4 / kv=q8), got {self.bits}")
        _check_group(self.group_size)
        _check_start(self.name, self.quantized_start)


@register("kv", "turbo")
@dataclass
class TurboKvConfig(KvConfig):
    """TurboQuant: affine keys, Hadamard-rotated Lloyd-Max values."""

    _target_: str = "pipeserve.kv.layouts.TurboLayout"
    k_bits: int = 8            # key bits (affine): 2, 4, 5 or 8
    v_bits: int = 3            # value bits (Lloyd-Max codebook after a Hadamard rotation): 2-5 or 8
    group_size: int = 64       # key elements sharing one scale and bias
    quantized_start: int = 0   # tokens a row keeps dense before it converts

    def __post_init__(self) -> None:
        if self.k_bits not in TURBO_K_BITS:
            raise ConfigError(f"kv.k_bits must be one of {', '.join(map(str, TURBO_K_BITS))} "
                              f"for kv=turbo, got {self.k_bits}")
        if self.v_bits not in TURBO_V_BITS:
            raise ConfigError(f"kv.v_bits must be one of {', '.join(map(str, TURBO_V_BITS))} "
                              f"for kv=turbo, got {self.v_bits}")
        _check_group(self.group_size)
        _check_start(self.name, self.quantized_start)


@register("kv", "mixed")
@dataclass
class MixedKvConfig(KvConfig):
    """Per-layer key/value bits from a kv_config.json (format: docs/generation.md, KV layouts)."""

    _target_: str = "pipeserve.kv.layouts.MixedLayout"
    config_path: str = MISSING   # the kv_config.json with each layer's key/value bits
    quantized_start: int = 0     # tokens a row keeps dense before it converts

    def __post_init__(self) -> None:
        _check_start(self.name, self.quantized_start)


@register("kv", "paged")
@dataclass
class PagedKvConfig(KvConfig):
    """Fixed-size blocks in one pool per layer; rows sharing a cached prefix share its blocks."""

    _target_: str = "pipeserve.kv.layouts.PagedLayout"
    block_size: int = 256   # tokens per KV block
    pool_blocks: Optional[int] = None   # blocks per layer; unset: from pool_gb, else from memory
    pool_gb: Optional[float] = None     # GiB for all layers' pools together

    def __post_init__(self) -> None:
        _positive("kv.block_size", self.block_size, allow_none=False)
        _positive("kv.pool_blocks", self.pool_blocks)
        _positive("kv.pool_gb", self.pool_gb)
        if self.pool_blocks is not None and self.pool_gb is not None:
            raise ConfigError(f"kv.pool_blocks={self.pool_blocks} and kv.pool_gb={self.pool_gb} "
                              "both size the pool; set one")
