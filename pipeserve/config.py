"""Typed configuration: one dataclass schema per config group option, registered in Hydra's
ConfigStore, and load_config() which turns a composed DictConfig into checked objects.
Runs at launch on the main thread, before any model load."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeserve import registry
from pipeserve.core.config import ContinuousSchedulerConfig, SamplingConfig, SchedulerConfig, SerialSchedulerConfig
from pipeserve.distributed.config import DistributedConfig, check_combination as check_distributed
from pipeserve.draft.config import DraftConfig
from pipeserve.errors import ConfigError
from pipeserve.http.config import SECRET_FIELDS, ServerConfig
from pipeserve.kv.config import KvConfig
from pipeserve.model.config import ModelConfig
from pipeserve.pool.config import PoolConfig
from pipeserve.prompt_cache.config import CacheConfig
from pipeserve.stages.config import AdmissionConfig, PipelineConfig
from pipeserve.vision.config import MediaConfig


@dataclass
class ServeConfig:
    model: ModelConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    sampling: SamplingConfig = MISSING
    admission: AdmissionConfig = MISSING
    server: ServerConfig = MISSING
    media: MediaConfig = MISSING
    pipeline: PipelineConfig = MISSING
    cache: CacheConfig = MISSING
    kv: KvConfig = MISSING
    draft: DraftConfig = MISSING
    distributed: DistributedConfig = MISSING
    pool: Optional[PoolConfig] = None   # pool=<name>: several models by id (pipeserve/pool/)


# group → option → schema, stored as schema/<group>/<option>. The groups of interchangeable
# options (admission, cache, kv, draft) are live views of pipeserve/registry.py, where each
# option is declared once, by `@register` on its schema.
SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"model": ModelConfig},
    "scheduler": {"serial": SerialSchedulerConfig, "continuous": ContinuousSchedulerConfig},
    "sampling": {"sampling": SamplingConfig},
    "server": {"server": ServerConfig},
    "media": {"media": MediaConfig},
    "pipeline": {"pipeline": PipelineConfig},
    "pool": {"pool": PoolConfig},
    **{group: registry.schemas(group) for group in registry.SCHEMA_MODULES},
}


def served_model_id(option: str, path: str | None) -> str:
    """`model.name` when the launch does not set it: the option's name (`smollm2`, `tiny`) for
    its own weights; for `model.path=...` the weights' own name, as mlx_lm.server and
    llama-server serve them: a directory's or file's name (`.gguf` dropped), or a Hugging
    Face id as written (`Qwen/Qwen3-0.6B`)."""
    if not path:
        return option
    local = Path(path).expanduser()
    if local.exists() or path.startswith(("/", ".", "~")):   # `dir/.`, `./`: the dir's name
        name = Path(os.path.normpath(local.absolute())).name   # a symlink keeps its own name
        return name.removesuffix(".gguf") or option
    return path.rstrip("/") or option


if not OmegaConf.has_resolver("pipeserve.model_id"):
    OmegaConf.register_new_resolver("pipeserve.model_id", served_model_id)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="serve_schema", node=ServeConfig)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def _check_keys(node: Any, path: str) -> None:
    """Reject keys that are not fields of their dataclass (`+x.y=...` gets past Hydra)."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        allowed = {f.name for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                raise ConfigError(
                    f"unknown config key '{where}' (value {node._get_node(key)}); "
                    f"{schema.__name__} has: {', '.join(sorted(allowed))}")
    for key in node.keys():
        _check_keys(node._get_node(key), f"{path}.{key}" if path else str(key))


def _check_key_refs(cfg: DictConfig) -> None:
    """A key given as a reference (`server.api_key=${oc.env:VAR}`) that does not resolve
    fails here with the reference named (never the value)."""
    server = cfg.get("server") if isinstance(cfg, DictConfig) else None
    if not isinstance(server, DictConfig):
        return
    for name in SECRET_FIELDS:
        if name not in server or not OmegaConf.is_interpolation(server, name):
            continue
        ref = server._get_node(name)._value()
        try:
            server[name]
        except Exception as e:  # oc.env's unset variable, a missing node, a resolver error
            msg = str(e).splitlines()[0].removeprefix("KeyError raised while resolving "
                                                       "interpolation: ").strip('"')
            raise ConfigError(f"server.{name}={ref} cannot be resolved: {msg}; set it before "
                              f"launch, or use server.{name.removesuffix('_file')}_file=<path>"
                              ) from e


def _import_target(target: str, where: str) -> None:
    module, _, name = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}._target_ '{target}' cannot be imported: {e}") from e


def load_config(cfg: DictConfig) -> ServeConfig:
    """Composed DictConfig → checked ServeConfig. Raises ConfigError naming key and value."""
    _check_keys(cfg, "")
    _check_key_refs(cfg)
    try:
        typed = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # OmegaConf's validation errors carry the key and value
        raise ConfigError(str(e)) from e
    assert isinstance(typed, ServeConfig)
    _import_target(typed.scheduler._target_, "scheduler")
    _import_target(typed.admission._target_, "admission")
    _import_target(typed.cache._target_, "cache")
    _import_target(typed.kv._target_, "kv")
    _import_target(typed.draft._target_, "draft")
    _check_combination(typed)
    for slot in dataclasses.fields(PipelineConfig):
        _import_target(getattr(typed.pipeline, slot.name)._target_, f"pipeline.{slot.name}")
    return typed


def check_overrides(overrides: list[str]) -> None:
    """Hydra keeps the last of two selections of one group; a server has one option per
    group, so a repeated group (`kv=turbo kv=paged`) is refused instead of half-honoured."""
    seen: dict[str, str] = {}
    media = {f.name for f in dataclasses.fields(MediaConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        group, _, leaf = key.lstrip("+~").partition(".")
        if group == "server" and leaf in media:
            raise ConfigError(f"server.{leaf} is media.{leaf} now (the media group holds what a "
                              f"request may send): {item} -> media.{leaf}={value}")
        if not sep or "." in key or key.startswith(("+", "~", "hydra")):
            continue
        if key in SCHEMAS and key in seen and seen[key] != value:
            hint = (" (kv=paged blocks hold dense KV; quantized layouts are not paged)"
                    if key == "kv" else "")
            raise ConfigError(f"{key} is selected twice ({key}={seen[key]} and {key}={value}); "
                              f"pick one option of {key}: "
                              f"{', '.join(SCHEMAS[key])}{hint}")
        seen[key] = value


def _check_combination(cfg: ServeConfig) -> None:
    """Compositions that cannot work are refused at launch, never downgraded (SPEC §3)."""
    check_distributed(cfg)   # what cannot work across ranks (pipeserve/distributed/config.py)
    if cfg.kv.name == "paged" and cfg.draft.name == "model":
        raise ConfigError("kv=paged with draft=model is not supported: the draft model's KV "
                          "would live outside the block pool; use kv=dense (or q4/q8/turbo)")


def config_hash(cfg: DictConfig | ServeConfig) -> str:
    """Short stable hash of the resolved config, for build info and reproducibility. The
    server's keys (SECRET_FIELDS) are left out: the hash is public (/metrics, every response's
    record), so it must not be an oracle for them."""
    node = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    server = node.get("server")
    if isinstance(server, DictConfig):
        for name in SECRET_FIELDS:
            if name in server:
                server[name] = None
    text = OmegaConf.to_yaml(node, resolve=True, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build(target: str, *args: Any, **kwargs: Any) -> Any:
    """Instantiate the class named by a `_target_` string with *args and **kwargs."""
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)
