"""The server's start: the engine starts before the listener, background responses left open
by the last launch resume, and the server turns ready once the engine is (or the launch
fails with one line saying why). Event loop."""
from __future__ import annotations

import asyncio
import logging
import sys
from importlib.metadata import PackageNotFoundError, version

from sanic import Sanic

from pipeserve.model import blas
from pipeserve.config import ServeConfig
from pipeserve.core.client import EngineClient
from pipeserve.errors import ConfigError
from pipeserve.http.api import background_resume
from pipeserve.http.api.record import base_record
from pipeserve.http.front import Front
from pipeserve.launch.checks import LAUNCH_ERROR, chat_url
from pipeserve.launch.stalls import StallWatch
from pipeserve.metrics import Metrics, quiet_collector

log = logging.getLogger("pipeserve")


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "unknown"


def add_startup(app: Sanic, cfg: ServeConfig, engine: EngineClient, metrics: Metrics) -> None:
    @app.after_server_start
    async def _restore(app: Sanic) -> None:
        await background_resume.restore(app)

    @app.before_server_start
    async def _start(app: Sanic) -> None:
        sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)   # process-wide
        if cfg.server.stall_report_ms > 0:
            app.ctx.stalls = StallWatch(asyncio.get_running_loop(),
                                        cfg.server.stall_report_ms / 1000).start()
        app.ctx.loop = asyncio.get_running_loop()   # an engine's death is handed to it (drain.py)
        engine.start()

    @app.before_server_stop
    async def _stop_watch(app: Sanic) -> None:
        if getattr(app.ctx, "stalls", None) is not None:
            app.ctx.stalls.stop()

    @app.after_server_start
    async def _wait_ready(app: Sanic) -> None:
        app.add_task(_ready(app, cfg, engine, metrics))


def event_loop_name() -> str:
    """The running event loop's implementation: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def _ready(app: Sanic, cfg: ServeConfig, engine: EngineClient, metrics: Metrics) -> None:
    """Waits (off the loop) for the engine to load, then makes the server ready."""
    page = (f"; chat page {chat_url(cfg.server.host, cfg.server.port)}"
            if cfg.server.chat_page else "")
    ok = await asyncio.get_running_loop().run_in_executor(None, engine.wait_ready)
    if not ok:
        await _failed(app, engine)
        return
    loop = event_loop_name()
    if loop != "uvloop":   # Sanic installs uvloop with itself; an install without it is slower
        log.warning("event loop: %s, not uvloop (pip install uvloop): every request's parsing "
                    "and every token's framing cost more on this loop", loop)
    if app.ctx.pool is not None:   # models load on first use (pipeserve/pool/)
        app.ctx.pool.started({"version": _version("pipeserve"),
                              "mlx_version": _version("mlx"),
                              "config_hash": app.ctx.config_hash,
                              "blas": blas.name or "bundled"})
        quiet_collector(metrics)
        log.info("ready: pool of %s, listening on %s:%d, event loop %s%s",
                 ", ".join(app.ctx.pool.ids), cfg.server.host, cfg.server.port, loop, page)
        return
    _model_ready(app, cfg, engine, metrics, page)


async def _failed(app: Sanic, engine: EngineClient) -> None:
    """The engine failed to start: the launch error (reported by serve.py, one line on
    stderr) and its exit code, and the server stops."""
    err = engine.startup_error
    if isinstance(err, ConfigError):
        app.ctx.launch_error = f"config error: {err}"
    else:
        log.error("engine failed to start: %r; stopping", err)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        app.ctx.launch_error = (f"the model failed to load ({type(err).__name__}: "
                                f"{first}); the log above has the details")
    app.ctx.exit_code = LAUNCH_ERROR
    await running(app)
    app.stop()


async def running(app: Sanic) -> None:
    """Returns once Sanic's startup listeners are done: the server may be stopped only then (a
    stop while they still run ends their run_until_complete instead of the server's
    run_forever, which then never returns)."""
    while not app.state.is_running:
        await asyncio.sleep(0.05)


def _model_ready(app: Sanic, cfg: ServeConfig, engine: EngineClient, metrics: Metrics,
                 page: str) -> None:
    """One model loaded: its record, its request front (none for an embedding model), the
    build info metric and the ready line."""
    limits = engine.limits
    loaded = limits.model
    loop = event_loop_name()
    adapter = loaded.adapter.identity if loaded.adapter is not None else None
    app.ctx.record = base_record(cfg, app.ctx.config_hash, loaded.fingerprint, adapter)
    app.ctx.front = None if cfg.model.encoder else Front(cfg, engine, metrics)
    quiet_collector(metrics)
    metrics.build.info({
        "version": _version("pipeserve"), "mlx_version": _version("mlx"),
        "device": limits.device, "model": cfg.model.name,
        "model_fingerprint": loaded.fingerprint, "config_hash": app.ctx.config_hash,
        "blas": blas.name or "bundled", "event_loop": loop})
    log.info("CPU BLAS: %s", blas.describe())
    log.info("ready: model %s from %s (%d params) on %s, listening on %s:%d, event loop %s%s",
             cfg.model.name, loaded.path.name, loaded.num_params, limits.device,
             cfg.server.host, cfg.server.port, loop, page)
