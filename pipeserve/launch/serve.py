"""pipeserve entry point: compose the config with Hydra, build the app, serve it.

    pipeserve                                # SmolLM2-135M demo model on 127.0.0.1:8080
    pipeserve model=qwen model.path=~/models/Qwen3-8B-4bit server.port=9000   # ~: home
    python serve.py ...                      # the same, from a checkout
    pipeserve fit model.path=~/models/q.gguf # will it fit? the estimate, before any load

Every launch error (a bad override, a model that is not there, a port in use, a model that
fails to load) is one or two lines on stderr and exit code 2 (pipeserve/launch/checks.py).
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeserve.launch import checks as launch
from pipeserve.config import ServeConfig, check_overrides, load_config, register_configs
from pipeserve.errors import ConfigError
from pipeserve.launch.overrides import expand_home
from pipeserve.launch.logs import own_threads, stop_threads
from pipeserve.launch.run_files import write_run_files
from pipeserve.launch.stacks import dump_stacks_on_sigusr1
from pipeserve.model.mlx_env import use_cuda_graphs
from pipeserve.distributed.lifeline import stop_self, watch_launcher
from pipeserve.distributed.shard import world
from pipeserve.pool.members import compose_members

log = logging.getLogger("pipeserve")
register_configs()
CONF = launch.conf_dir()


def main() -> None:
    """The `pipeserve` command and `python serve.py`: our --help and override check, then
    Hydra's main (which owns the run dir and logging)."""
    args = sys.argv[1:] = expand_home(sys.argv[1:])   # `model.path=~/x` as in a shell
    if args[:1] == ["fit"]:   # `pipeserve fit ...`: the memory estimate, no server, no load
        from pipeserve.launch.fit import main as fit
        fit(args[1:])
        _exit(0)
    if any(a in ("-h", "--help") for a in args):
        print(launch.help_text(CONF))
        return
    overrides = [a for a in args if not a.startswith("-")]
    if len(overrides) == len(args):   # Hydra's own flags (--cfg, -m, ...) get Hydra's handling
        if sys.stdout.isatty():   # a person waiting: words at once, before seconds of imports
            print("pipeserve: starting: config, then MLX and the server, then the model "
                  "(a first use fetches or converts it); the log follows", flush=True)
        try:
            check_overrides(overrides)
            launch.check_overrides_compose(CONF, overrides)
        except ConfigError as e:
            launch.fail(f"config error: {e}")
    hydra_main()


@hydra.main(config_path=str(CONF), config_name="serve", version_base="1.3")
def hydra_main(raw: DictConfig) -> None:
    try:
        serve(raw)
    except SystemExit:
        raise
    except Exception:
        # reported here, not by Hydra: its report echoes the overrides, literal keys included
        log.exception("serve.py failed")
        _exit(1)


def serve(raw: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    # the imports (load_config imports every stage, and MLX with them) take seconds
    log.info("starting: importing MLX and the server, then loading the model %s",
             OmegaConf.select(raw, "model.path", throw_on_resolution_failure=False)
             or hydra_cfg.runtime.choices.get("model"))
    write_run_files(raw, hydra_cfg)   # literal keys redacted (Hydra's own writer is off)
    dump_stacks_on_sigusr1()
    # before anything imports MLX (world() below, load_config's stages), which reads it once
    use_cuda_graphs(OmegaConf.select(raw, "server.cuda_graphs", default=None))
    if hydra_cfg.runtime.choices.get("distributed", "none") != "none":
        # join the group before the imports below: MLX's ring connect retries for about 15 s,
        # and ranks whose imports run at different speeds (a loaded host, a cold disk) can
        # reach it further apart than that
        world()
    try:
        # unresolved: an override may be a reference (`server.api_key=${oc.env:VAR}`)
        check_overrides(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))
        cfg = load_config(raw)
        own_threads(cfg.server.log_buffer_records)   # no thread that logs waits on a log's reader
        members = compose_members(cfg, list(hydra_cfg.overrides.task))   # pool=...: each model's config
        _check_models(cfg, members)
        if not cfg.distributed.enabled:   # rank 0 of a group is known only once MLX runs
            launch.check_port(cfg.server.host, cfg.server.port)
    except ConfigError as e:
        log.debug("config error: %s", e)   # into the run's log file; the terminal gets one line
        _fail(f"config error: {e}")
    if cfg.distributed.enabled:   # mlx.launch: ranks > 0 follow rank 0 and never listen
        from pipeserve.distributed.follower import follow
        if (code := follow(cfg)) is not None:
            _exit(code)
        watch_launcher(stop_self)   # rank 0: a lost launcher drains and stops the group
    from pipeserve.http.server import Protocol, build_app
    app = build_app(cfg, members=members, launch=list(hydra_cfg.overrides.task))
    app.ctx.exit_code = 0
    app.ctx.launch_error = None
    try:
        app.run(host=cfg.server.host, port=cfg.server.port, single_process=True,
                access_log=False, motd=False, backlog=cfg.server.backlog, protocol=Protocol)
    except OSError as e:   # lost the port between check_port and the bind
        _fail(f"config error: {launch.port_message(cfg.server.host, cfg.server.port, e)}")
    if app.ctx.launch_error:   # the engine could not load the model
        _fail(app.ctx.launch_error)
    # The engine has stopped and the prompt cache is flushed and closed by now.
    _exit(app.ctx.exit_code)


def _check_models(cfg: ServeConfig, members: dict[str, ServeConfig] | None) -> None:
    """model.path exists, before anything loads. A pool's members load on first use and one
    that fails is a 503 for its id while the others serve (pipeserve/pool/), so not here."""
    from pipeserve.model.loader import locate
    if not members and cfg.model.path is not None:
        locate(cfg.model)


def _fail(message: str) -> None:
    print(f"pipeserve: {launch.one_line(message)}", file=sys.stderr)
    _exit(launch.LAUNCH_ERROR)


def _exit(code: int) -> None:
    """Exit without interpreter teardown: destroying MLX's C++ thread state during it can
    abort (SIGABRT)."""
    if stop_threads():   # else a handler's reader is stuck, and a flush would wait on it
        logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
