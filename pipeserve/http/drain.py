"""The server's stop: the first SIGINT/SIGTERM drains (new API requests get 503 while the
engine finishes what it holds), a second stops at once; an engine on a thread of the server
that dies while serving stops it too, with ENGINE_DIED; then the prompt cache is flushed and
the engine stopped. Event loop."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from sanic import Sanic

from pipeserve.config import ServeConfig
from pipeserve.core.client import EngineClient, EngineState
from pipeserve.http.api import responses_background
from pipeserve.http.startup import running
from pipeserve.http.waits import flushed
from pipeserve.launch.checks import ENGINE_DIED
from pipeserve.metrics import Metrics

log = logging.getLogger("pipeserve")
DEATH_GRACE_S = 5.0   # the most a dead engine's failed responses get to go out before the exit


def add_drain(app: Sanic, cfg: ServeConfig, engine: EngineClient, metrics: Metrics) -> None:
    app.ctx.draining = False
    app.ctx.drain_task = None

    @app.after_server_start
    async def _signals(app: Sanic) -> None:
        # Replaces Sanic's handlers (installed just before this event), which stop the
        # listener at once: drain with the listener open instead (see _drain).
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, app, sig)

    @app.before_server_stop
    async def _stopping(app: Sanic) -> None:
        if app.ctx.resume_task is not None:
            app.ctx.resume_task.cancel()
        if not app.ctx.draining:   # stopped without a signal (engine failed to start)
            app.ctx.draining = True
            log.info("shutting down: %d request(s) in flight", engine.load().num_inflight)

    @app.after_server_stop
    async def _stop(app: Sanic) -> None:
        left = engine.load().num_inflight
        if left:
            log.warning("shutdown timeout: %d request(s) were cut off", left)
        if engine.state is EngineState.DEAD:   # it takes no commands; its thread's exit
            log.info("prompt cache: not flushed, the engine died (its thread's exit writes "
                     "what it can)")   # drains the SSD writer (core/engine.py _run)
        else:
            t0 = time.perf_counter()
            ok = await flushed(engine, 300)
            metrics.cache_flush_seconds.observe(time.perf_counter() - t0)
            log.info("prompt cache %s in %.2f s", "flushed" if ok else "NOT fully flushed",
                     time.perf_counter() - t0)
        engine.stop()


def _on_signal(app: Sanic, sig: signal.Signals) -> None:
    """First SIGINT/SIGTERM: drain. A second one: stop now, cutting off what is in flight."""
    if app.ctx.draining:
        log.warning("%s again: stopping now, %d request(s) in flight are cut off",
                    sig.name, app.ctx.engine.load().num_inflight)
        if app.ctx.drain_task is not None:
            app.ctx.drain_task.cancel()
        app.config.GRACEFUL_SHUTDOWN_TIMEOUT = 0
        app.stop(terminate=False)
        return
    app.ctx.draining = True   # new /v1/ requests get 503 + Retry-After, /health 503 draining
    timeout = app.ctx.cfg.server.shutdown_timeout_s
    log.info("%s: draining; %d request(s) in flight; new requests get 503; waiting up to %.0f s",
             sig.name, app.ctx.engine.load().num_inflight, timeout)
    app.ctx.drain_task = asyncio.get_running_loop().create_task(_drain(app, timeout))


def on_engine_death(app: Sanic) -> Callable[[], None]:
    """The `on_death` of an Engine on a thread of this server (server.exit_on_engine_death):
    any thread, once the engine died while serving (its loop raised, or a distributed rank is
    gone). It hands _exit_on_death to the event loop the engine was started from."""
    def died() -> None:
        try:
            app.ctx.loop.call_soon_threadsafe(_exit_on_death, app)
        except RuntimeError:   # the loop is closed: the server has stopped already
            pass
    return died


def _exit_on_death(app: Sanic) -> None:
    """The server stops as a drain does, over a short grace for the 503s already decided to
    go out, and exits with ENGINE_DIED: a device the dead engine left unusable (a corrupt CUDA
    context) serves again only in a new process, which the supervisor starts. A pool restarts
    its engine processes itself; a start that fails is startup.py's (LAUNCH_ERROR)."""
    app.ctx.exit_code = ENGINE_DIED
    log.error("engine died (its error is logged above): the requests in flight were failed "
              "with 503; the server exits with status %d so that its supervisor starts it "
              "again (server.exit_on_engine_death=false keeps it up, answering 503)",
              ENGINE_DIED)
    if app.ctx.draining:   # a drain is stopping the server already
        return
    app.ctx.draining = True
    timeout = min(DEATH_GRACE_S, app.ctx.cfg.server.shutdown_timeout_s)
    app.ctx.drain_task = asyncio.get_running_loop().create_task(_drain(app, timeout))


async def _drain(app: Sanic, timeout: float) -> None:
    """The listener stays open while the engine finishes what it holds (or the timeout hits);
    then Sanic's own shutdown gets what is left of the timeout to finish writing responses
    still open (a stream's last chunks, a request that was still being tokenized)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await running(app)   # a signal or an engine's death may come during Sanic's startup
    await responses_background.suspend(app)   # on disk, for the next launch to resume
    while app.ctx.engine.load().num_inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = max(deadline - loop.time(), 0.0)
    left = app.ctx.engine.load().num_inflight
    if left:
        log.warning("drain timeout: %d request(s) still in flight after %.0f s; stopping",
                    left, timeout)
    else:
        log.info("drained: no request in flight; stopping the listener")
    app.stop(terminate=False)
