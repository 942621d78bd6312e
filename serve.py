"""pipeserve entry point: compose the config with Hydra, build the app, serve it.

    python serve.py                          # embedded tiny model on 127.0.0.1:8080
    python serve.py model=qwen model.path=~/models/Qwen3-8B-4bit server.port=9000
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeline.config import check_overrides, register_configs, load_config
from pipeline.errors import ConfigError
from pipeline.run_files import write_run_files

log = logging.getLogger("pipeserve")
register_configs()


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        serve(raw)
    except Exception:
        # reported here, not by Hydra: its report echoes the overrides, literal keys included
        log.exception("serve.py failed")
        _exit(1)


def serve(raw: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    write_run_files(raw, hydra_cfg)   # literal keys redacted (Hydra's own writer is off)
    try:
        # unresolved: an override may be a reference (`server.api_key=${oc.env:VAR}`)
        check_overrides(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))
        cfg = load_config(raw)
        from pipeline.pool.members import compose_members   # pool=...: each model's config
        members = compose_members(cfg, list(hydra_cfg.overrides.task))
    except ConfigError as e:
        log.error("config error: %s", e)
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.distributed.enabled:   # mlx.launch: ranks > 0 follow rank 0 and never listen
        from pipeline.distributed.follower import follow
        if (code := follow(cfg)) is not None:
            _exit(code)
        from pipeline.distributed.lifeline import stop_self, watch_launcher
        watch_launcher(stop_self)   # rank 0: a lost launcher drains and stops the group
    from pipeline.server import build_app
    app = build_app(cfg, members=members)
    app.ctx.exit_code = 0
    app.run(host=cfg.server.host, port=cfg.server.port, single_process=True, access_log=False,
            motd=False)
    # The engine has stopped and the prompt cache is flushed and closed by now.
    _exit(app.ctx.exit_code)


def _exit(code: int) -> None:
    """Exit without interpreter teardown: destroying MLX's C++ thread state during it can
    abort (SIGABRT)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
