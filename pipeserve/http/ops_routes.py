"""The operator's routes: HEAD probes, /health, /metrics and the prompt-cache flush.
Event loop."""
from __future__ import annotations

import time
from typing import Callable

import sanic
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sanic import HTTPResponse, Sanic

from pipeserve.core.client import EngineClient, EngineState
from pipeserve.errors import Unauthorized
from pipeserve.http.api.http import json_response
from pipeserve.http.keys import key_ok
from pipeserve.http.waits import flushed


def add_routes(app: Sanic, admin: Callable[[sanic.Request], None]) -> None:
    """`admin(http)`: raises 401 unless the request carries server.admin_key (when set)."""
    async def head(http: sanic.Request) -> HTTPResponse:
        """Agents probe the root and the API root with HEAD before their first request."""
        return HTTPResponse(status=200)
    app.add_route(head, "/", methods=["HEAD"], name="head_root")
    app.add_route(head, "/v1", methods=["HEAD"], name="head_v1", strict_slashes=False)

    @app.get("/health")
    async def health(http: sanic.Request) -> HTTPResponse:
        engine: EngineClient = app.ctx.engine
        draining = getattr(app.ctx, "draining", False)
        ready = (engine.state is EngineState.READY and not draining
                 and (app.ctx.front is not None or app.ctx.pool is not None
                      or app.ctx.cfg.model.encoder))
        state = "draining" if draining else ("ok" if ready else engine.state.value)
        pool = app.ctx.pool   # a pool: its models by id and their state (loaded, loading, …)
        model = (app.ctx.cfg.model.name if pool is None
                 else {m["id"]: m["state"] for m in pool.models_body()["data"]})
        load = engine.load()
        return json_response({"status": state, "model": model,
                              "waiting": load.num_waiting, "inflight": load.num_inflight},
                             200 if ready else 503)

    @app.post("/admin/cache/flush")
    async def flush(http: sanic.Request) -> HTTPResponse:
        """Returns once every dirty prompt-cache entry is on disk."""
        admin(http)
        t0 = time.perf_counter()
        ok = await flushed(app.ctx.engine, 600)
        app.ctx.metrics.cache_flush_seconds.observe(time.perf_counter() - t0)
        return json_response({"flushed": ok, "seconds": round(time.perf_counter() - t0, 4)},
                             200 if ok else 503)

    @app.get("/metrics")
    async def metrics(http: sanic.Request) -> HTTPResponse:
        server = app.ctx.cfg.server
        if server.metrics_auth:   # the admin key guards /metrics; the API key when none is set
            name = "admin_key" if server.admin_key else "api_key"
            if not key_ok(http, getattr(server, name)):
                raise Unauthorized(f"/metrics needs a key (server.metrics_auth=true); send "
                                   f"Authorization: Bearer <server.{name}>")
        text = (await app.ctx.pool.exposition() if app.ctx.pool is not None
                else generate_latest(app.ctx.registry))
        return HTTPResponse(text, content_type=CONTENT_TYPE_LATEST)
