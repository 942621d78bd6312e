"""A pool's members as full configs: each is `serve` composed from the launch's own overrides
(minus `pool*` and `hydra*`) with the member's overrides on top, `model.name` set to its id,
and checked by load_config — so a member's typo fails at launch. Main thread, at launch."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from pipeserve.config import ServeConfig, check_overrides, load_config
from pipeserve.errors import ConfigError
from pipeserve.pool.scan import scan
from pipeserve.prompt_cache.config import RAM_FLOOR_GB

CONF = Path(__file__).resolve().parent.parent / "conf"


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def member_overrides(launch: list[str], member: list[str], model_id: str) -> list[str]:
    """The launch's overrides a member inherits, then its own: a group the member selects
    (`model=llama`) or a key it sets replaces the launch's, never repeats it."""
    mine = {_key(o) for o in member}
    base = [o for o in launch
            if not _key(o).startswith(("pool", "hydra")) and _key(o) not in mine
            and not (_key(o) == "model.name")]
    return [*base, *member, f"model.name={model_id}"]


def _compose(overrides: list[str]) -> ServeConfig:
    check_overrides(overrides)
    if GlobalHydra.instance().is_initialized():   # inside serve.py's @hydra.main
        return load_config(compose("serve", overrides=overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_config(compose("serve", overrides=overrides))


def compose_member(launch: list[str], model_id: str, overrides: list[str]) -> ServeConfig:
    """One member's ServeConfig: the launch's overrides, then its own (checked: a member sets
    its model and engine, never the server or the pool)."""
    for o in overrides:
        if _key(o).startswith(("pool", "server", "hydra")):
            raise ConfigError(f"pool.models.{model_id}.overrides has {o!r}: a member sets "
                              "its model, kv, draft, cache, scheduler, admission, sampling "
                              "or pipeline; the server and the pool are the launch's")
    try:
        cfg = _compose(member_overrides(launch, overrides, model_id))
    except ConfigError as e:
        raise ConfigError(f"pool.models.{model_id}: {e}") from e
    except Exception as e:  # Hydra's compose errors (an unknown group option)
        raise ConfigError(f"pool.models.{model_id}: {str(e).splitlines()[0]}") from e
    return cfg


def compose_members(cfg: ServeConfig, launch: list[str]) -> dict[str, ServeConfig] | None:
    """id → that model's ServeConfig; None for a launch that runs its one model in-process.
    `server.isolate=true` without a pool is a pool of that one model."""
    isolate = cfg.server.isolate
    if cfg.pool is None:
        return {cfg.model.name: cfg} if isolate else None
    if isolate is False:
        raise ConfigError("server.isolate=false with pool=...: a pool runs each model in its "
                          "own process (that is what lets it unload one and survive a crash); "
                          "drop server.isolate, or serve one model without pool")
    members: dict[str, ServeConfig] = {}
    listed = {i: list(m.overrides) for i, m in cfg.pool.models.items()}
    found = scan(cfg.pool.model_dir) if cfg.pool.model_dir is not None else {}
    for model_id, overrides in {**listed, **found, **listed}.items():
        members[model_id] = compose_member(launch, model_id, overrides)
    if len(members) > 1:   # members share the device: none fits its RAM tier to all of it
        for member in members.values():
            if member.cache.ram_gb is None and member.cache.enabled:
                member.cache.ram_gb = RAM_FLOOR_GB
    if not members:
        raise ConfigError(f"pool.model_dir {cfg.pool.model_dir!r} holds no model (a directory "
                          "with config.json and *.safetensors, or a .gguf file) and pool.models "
                          "is empty")
    return members
