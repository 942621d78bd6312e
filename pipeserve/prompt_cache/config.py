"""The `cache` group's options: the RAM prefix cache, its SSD tier, or none. Imports no mlx:
checked at launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from pipeserve import registry
from pipeserve.errors import ConfigError, check_positive as _positive
from pipeserve.registry import register


RAM_FLOOR_GB = 8.0   # the fitted RAM tier's least size (the fixed default before fitting)


@dataclass
class SsdConfig:
    dir: str = "~/.cache/pipeserve/prompt-cache"  # diskcache directory; survives restarts
    max_gb: float = 0.0           # GiB on disk; 0 = unlimited (oldest entries evicted past it)
    demote_idle_s: float = 300.0  # RAM entries idle this long are written to disk
    verify: bool = False          # hash every tensor on restore (the header is always checked)
    write_behind: bool = True     # snapshot settled entries in the background


@dataclass
class CacheConfig:
    _target_: str = MISSING
    # GiB of KV the RAM tier keeps (byte-capped LRU); unset: fitted at load to two entries of
    # the longest context the server takes, at least 8, at most a quarter of the device memory
    # the weights leave
    ram_gb: Optional[float] = None
    checkpoint_every: Optional[int] = None  # tokens between generation checkpoints (cache=ssd)
    # keep the state at the end of each chat's history (before the generation prompt) as well
    # as at the end of the prompt and of the reply: the next turn of an agent session renders
    # that history again, so a model with recurrent layers (which cannot rewind) reuses it
    session_checkpoints: bool = True
    # idle warm-up: after a chat turn, while the engine has nothing else to do, prefill the
    # history with this answer (the next turn's likely prefix) when it costs at most this many
    # new tokens; a real request cancels it at the next step. 0: off
    warmup_budget_tokens: int = 0
    # a reusable prefix shorter than this is computed again instead: a hit's merge into its
    # batch copies it a row, layer and tensor at a time, more than a short prefix's share of a
    # batched prefill costs (measured: docs/notes/2026-12-07-round26.md). 0: any hit; unset:
    # 256 on a GPU, 0 on a CPU (whose prefill is the slow part)
    min_reuse_tokens: Optional[int] = None

    @property
    def name(self) -> str:
        """The option (`cache=<name>`)."""
        return registry.name_of(self)

    @property
    def enabled(self) -> bool:
        """A prompt cache is built (every option but cache=off)."""
        return True

    def __post_init__(self) -> None:
        if self.ram_gb is not None and self.ram_gb < 0:
            raise ConfigError(f"cache.ram_gb must be >= 0, got {self.ram_gb}")
        _positive("cache.checkpoint_every", self.checkpoint_every)
        if self.min_reuse_tokens is not None and self.min_reuse_tokens < 0:
            raise ConfigError(
                f"cache.min_reuse_tokens must be >= 0 (0: any hit), got {self.min_reuse_tokens}")
        if self.warmup_budget_tokens < 0:
            raise ConfigError(
                f"cache.warmup_budget_tokens must be >= 0 (0: off), got {self.warmup_budget_tokens}")
        if self.checkpoint_every is not None and self.name != "ssd":
            raise ConfigError(
                f"cache.checkpoint_every={self.checkpoint_every} needs cache=ssd (checkpoints "
                f"live on disk), got cache={self.name}")


@register("cache", "ram")
@dataclass
class RamCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.ram.RamPromptCache"


@register("cache", "ssd")
@dataclass
class SsdCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.tiered.TieredPromptCache"
    ssd: SsdConfig = field(default_factory=SsdConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ssd.max_gb < 0:
            raise ConfigError(f"cache.ssd.max_gb must be >= 0 (0 = unlimited), got {self.ssd.max_gb}")
        _positive("cache.ssd.demote_idle_s", self.ssd.demote_idle_s, allow_none=False)


@register("cache", "off")
@dataclass
class OffCacheConfig(CacheConfig):
    _target_: str = "pipeserve.prompt_cache.ram.RamPromptCache"
    ram_gb: Optional[float] = 0.0

    @property
    def enabled(self) -> bool:
        return False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ram_gb not in (None, 0):
            raise ConfigError(f"cache=off keeps nothing; got cache.ram_gb={self.ram_gb} "
                              "(use cache=ram to set a RAM budget)")
