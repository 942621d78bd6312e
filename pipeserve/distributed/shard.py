"""The model split across the group's ranks with mlx-lm's own sharding: `model.shard(group)`
(tensor parallel: attention heads and MLP columns) or `model.model.pipeline(group)` (pipeline
parallel: contiguous layers per rank), as `mlx_lm.utils.sharded_load` does, applied to the
lazily loaded model before its weights are read. A model mlx-lm cannot split this way, or a
rank count its heads do not divide, is refused naming the model and the numbers. Engine
thread, at load."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeserve.errors import ConfigError


def world() -> Any:
    """The group `mlx.launch` started (one rank when launched without it)."""
    import mlx.core as mx
    return mx.distributed.init()


def sharding(cfg: Any) -> Callable[[Any, dict[str, Any]], None] | None:
    """The loader's hook for `cfg.distributed` (None: the model stays whole)."""
    if not cfg.distributed.enabled:
        return None
    mode = cfg.distributed.name
    return lambda model, config: shard(model, config, mode)


def shard(model: Any, config: dict[str, Any], mode: str) -> None:
    group = world()
    n = group.size()
    kind = config.get("model_type", type(model).__module__)
    inner = getattr(model, "model", None)
    if mode == "tensor" and not hasattr(model, "shard"):
        raise ConfigError(f"distributed=tensor: {kind} has no tensor-parallel shard() in "
                          f"mlx-lm {_version()}; use distributed=pipeline if it has "
                          "pipeline(), or a model mlx-lm shards (llama, qwen2, qwen3, "
                          "qwen3_moe, qwen3_5, deepseek_v3, gpt_oss, ...)")
    if mode == "pipeline" and (inner is None or not hasattr(inner, "pipeline")):
        raise ConfigError(f"distributed=pipeline: {kind} has no pipeline() in mlx-lm "
                          f"{_version()}; use distributed=tensor if it has shard(), or a "
                          "model mlx-lm pipelines (qwen2, qwen3_5, qwen3_next, qwen3_moe, "
                          "deepseek_v3, ...)")
    if n < 2:
        raise ConfigError(f"distributed={mode} needs 2 or more ranks, this process is alone "
                          "(rank 0 of 1): launch it with `mlx.launch --backend ring -n 2 "
                          f"serve.py ... distributed={mode}`, or use distributed=none")
    if mode == "tensor":
        check_divisible(config, n)
        model.shard(group)
        return
    num_layers = len(inner.layers)
    if num_layers < n:
        raise ConfigError(f"distributed=pipeline: {kind} has {num_layers} layers, fewer than "
                          f"the {n} ranks; launch at most {num_layers} ranks")
    inner.pipeline(group)


def check_divisible(config: dict[str, Any], n: int) -> None:
    """Tensor parallelism splits heads and MLP columns evenly (mlx-lm's shard_linear): each
    must be a multiple of the rank count."""
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "moe_intermediate_size", "shared_expert_intermediate_size",
                "linear_num_value_heads", "linear_num_key_heads"):
        value = text.get(key)
        if isinstance(value, int) and value % n:
            raise ConfigError(f"distributed=tensor over {n} ranks: the model's {key} is "
                              f"{value}, not a multiple of {n}; launch a rank count that "
                              f"divides it (e.g. {_divisors(value)}) or use "
                              "distributed=pipeline")


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(2, min(value, 16) + 1) if value % d == 0) or "none"


def _version() -> str:
    from importlib.metadata import version
    return version("mlx-lm")
