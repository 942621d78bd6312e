"""Schema of the `pool` config group: the models a pool serves, by id, and its residency
rules. Imports no mlx; checked at launch by load_config()."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from pipeserve.errors import ConfigError

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class PoolMemberConfig:
    # Hydra overrides composed over the launch's own ones for this model, e.g.
    # [model=tiny, model.arch=llama, kv=q8]; model.name is set to the member's id
    overrides: list[str] = field(default_factory=list)


@dataclass
class PoolConfig:
    models: dict[str, PoolMemberConfig] = MISSING  # id → member; requests pick one by `model`
    default: Optional[str] = None  # id a request without `model` runs on; None: the first id
    max_resident: int = 2         # models loaded at once; loading another evicts the LRU idle one
    # weights of the resident models (decimal GB) at most this: loading another first unloads
    # least recently used idle ones; None: only max_resident bounds them
    memory_gb: Optional[float] = None
    idle_unload_s: float = 0.0    # unload a model idle this long (seconds); 0 = never
    load_timeout_s: float = 120.0  # a request waits at most this long for its model to load
    # every model directory (config.json + *.safetensors) or .gguf file directly under it is a
    # member too, its id the directory's (or file's) name; POST /v1/models/rescan looks again
    model_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.models and self.model_dir is None:
            raise ConfigError("pool.models is empty; list at least one model under an id, or "
                              "set pool.model_dir to a directory of models")
        for model_id in self.models:
            if not ID_PATTERN.match(model_id):
                raise ConfigError(
                    f"pool.models has id {model_id!r}; ids are 1-64 letters, digits, '.', '_' "
                    "or '-' (no ':', which selects an adapter), starting with a letter or digit")
        if self.default is not None and self.default not in self.models:
            raise ConfigError(f"pool.default={self.default} is not one of pool.models: "
                              f"{', '.join(self.models)}")
        if self.max_resident < 1:
            raise ConfigError(f"pool.max_resident must be >= 1, got {self.max_resident}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ConfigError(f"pool.memory_gb must be > 0 (or unset), got {self.memory_gb}")
        if self.idle_unload_s < 0:
            raise ConfigError(f"pool.idle_unload_s must be >= 0 (0 = never), got "
                              f"{self.idle_unload_s}")
        if self.load_timeout_s <= 0:
            raise ConfigError(f"pool.load_timeout_s must be > 0, got {self.load_timeout_s}")

    @property
    def default_id(self) -> str | None:
        """The id a request without `model` runs on (None: a model_dir pool found none)."""
        return self.default if self.default is not None else next(iter(self.models), None)
