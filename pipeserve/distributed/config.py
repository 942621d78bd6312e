"""The `distributed` config group: `none` (one process, the default), `tensor` (every layer's
weights split across the ranks by the model's own mlx-lm `shard()`), `pipeline` (the layers split
across the ranks by mlx-lm's `model.pipeline()`). What cannot work across ranks is refused here,
at launch, naming the reason. Launch time, main thread; no mlx import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeserve.errors import ConfigError
from pipeserve.registry import name_of, register


@dataclass
class DistributedConfig:
    """How the model is spread over the ranks `mlx.launch` started (SPEC §3)."""

    _target_: str = "pipeserve.distributed.group.Group"
    heartbeat_s: float = 1.0   # an idle rank 0 syncs the group this often (seconds), so a
                               #   lost rank is noticed while no request runs
    linger_s: float = 5.0      # after the group broke, rank 0 answers /health 503 this long
                               #   (seconds), then stops its server so mlx.launch ends the job;
                               #   server.exit_on_engine_death stops it sooner, once its
                               #   503s are out, with status 70
    timeout_s: float = 60.0    # a rank that has not synced for this long (seconds: one step
                               #   plus a heartbeat) means the group is stuck: it stops;
                               #   counted from the first sync (ranks load at their own pace)

    @property
    def name(self) -> str:
        """The option (`distributed=<name>`)."""
        return name_of(self)

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def __post_init__(self) -> None:
        if not 0.05 <= self.heartbeat_s <= 60:
            raise ConfigError(f"distributed.heartbeat_s must be in [0.05, 60] seconds, got "
                              f"{self.heartbeat_s}")
        if self.timeout_s <= self.heartbeat_s:
            raise ConfigError(f"distributed.timeout_s ({self.timeout_s}) must be longer than "
                              f"distributed.heartbeat_s ({self.heartbeat_s})")
        if self.linger_s < 0:
            raise ConfigError(f"distributed.linger_s must be >= 0 seconds, got {self.linger_s}")


@register("distributed", "none", labelled=False)
@dataclass
class NoDistributedConfig(DistributedConfig):
    pass


@register("distributed", "tensor")
@dataclass
class TensorConfig(DistributedConfig):
    pass


@register("distributed", "pipeline")
@dataclass
class PipelineParallelConfig(DistributedConfig):
    pass


def check_combination(cfg: Any) -> None:
    """Features that cannot work across ranks yet are refused at launch, never dropped."""
    d = cfg.distributed
    if not d.enabled:
        return
    why = f"distributed={d.name}"
    if cfg.cache.name == "ssd":
        raise ConfigError(f"cache=ssd with {why} is not supported: each rank holds only its shard "
                          "of a prefix's KV, and the SSD tier (and its checkpoints) keep one "
                          "process's entries; use cache=ram (every rank keeps its shard) or "
                          "cache=off")
    if cfg.draft.enabled:
        what = (f"draft={cfg.draft.name}" if cfg.draft.proposes
                else f"draft.fast_forward={cfg.draft.fast_forward}")
        raise ConfigError(f"{what} with {why} is not supported yet: proposers "
                          "and verify's rollback run on one process's state; use draft=none "
                          "with draft.fast_forward=0")
    m = cfg.model
    if m.adapter_dir is not None or m.adapter is not None or m.adapters:
        raise ConfigError(f"LoRA adapters (model.adapter_dir / model.adapter / model.adapters) "
                          f"with {why} are not supported: the adapters' A/B matrices would have "
                          "to be sharded like the layers they wrap; serve the fused model "
                          "(mlx_lm.fuse) instead")
    if getattr(cfg, "pool", None) is not None or getattr(cfg.server, "isolate", None):
        raise ConfigError(f"pool= / server.isolate=true with {why} is not supported: the ranks "
                          "run the engine in the processes mlx.launch started, not in children "
                          "of rank 0; serve one model per group")
    if d.name == "pipeline" and cfg.kv.name != "dense":
        raise ConfigError(f"kv={cfg.kv.name} with {why} is not supported yet: mlx-lm's pipeline "
                          "ties each rank's send to its last layer's cache through that cache's "
                          "`keys`, which pipeserve's quantized and paged caches do not expose "
                          "(the send would never run); use kv=dense, or distributed=tensor")
    if d.name == "pipeline" and cfg.admission.kv_budget_gb is not None:
        raise ConfigError(f"admission.kv_budget_gb with {why} is not supported: each rank holds "
                          "different layers, so the ranks would measure different KV sizes and "
                          "admit differently; leave it unset (or use distributed=tensor)")
