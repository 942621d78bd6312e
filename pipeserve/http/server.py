"""build_app(cfg): the Sanic app — routes, metrics endpoint — around one Engine; its startup
(startup.py), drain (drain.py), middleware (middleware.py) and error handlers
(error_handlers.py) live beside it.
Handlers run on the event loop and never call MLX; the engine thread does."""
from __future__ import annotations

import dataclasses
import secrets
import time
from functools import partial
from pathlib import Path
from typing import Any

import sanic
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import anthropic, openai_http, responses, resume, scripting_routes
from pipeserve.http.api import responses_background
from pipeserve.http.api.background_store import BackgroundStore
from pipeserve.http.api.http import json_response, read_body
from pipeserve.http.api.record import base_record
from pipeserve.http.api.resume import StreamStore
from pipeserve.http.api.store import ResponseStore
from pipeserve.http.api.warmup import Warmup
from pipeserve.http.batch import routes as batch_routes
from pipeserve.http.chat_page import add_chat_page
from pipeserve.http.waits import flushed
from pipeserve.http import drain, startup
from pipeserve.config import ServeConfig, config_hash
from pipeserve.core.client import EngineClient, EngineState
from pipeserve.core.engine import Engine
from pipeserve.errors import EngineUnavailable, Unauthorized
from pipeserve.http.error_handlers import add_error_handlers
from pipeserve.http.keys import key_ok, require_admin
from pipeserve.http.middleware import add_middleware
from pipeserve.metrics import Metrics
from pipeserve.adapters import swap as adapter_swap
from pipeserve.core.events import AdapterSwap
from pipeserve.embed.engine import EmbedEngine
from pipeserve.errors import InvalidRequest
from pipeserve.pool.client import PoolEngine
from pipeserve.pool.pool import ModelPool


def build_app(cfg: ServeConfig, *, name: str = "pipeserve",
              members: dict[str, ServeConfig] | None = None,
              launch: list[str] | None = None, engine: EngineClient | None = None) -> Sanic:
    """`members` (pipeserve/pool/members.py): the models of a pool by id, each engine in its
    own process; None serves cfg's one model in-process. `launch`: the launch's overrides
    (members found later by POST /v1/models/rescan compose over them). `engine`: the
    EngineClient to serve (a test's scripted one); None builds the one cfg names."""
    app = Sanic(name, configure_logging=False)
    app.config.REQUEST_MAX_SIZE = int(cfg.server.max_body_mb * 1_000_000)
    app.config.RESPONSE_TIMEOUT = 24 * 3600
    app.config.REQUEST_TIMEOUT = 600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    # SIGINT/SIGTERM: stop admitting, let requests in flight finish for this long.
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = cfg.server.shutdown_timeout_s
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    app.ctx.pool = None
    if members:
        app.ctx.pool = ModelPool(cfg, members, app.ctx, registry, launch)
    if engine is None:
        engine = _engine(cfg, app.ctx.pool, metrics)
    app.ctx.cfg, app.ctx.metrics, app.ctx.registry, app.ctx.engine = cfg, metrics, registry, engine
    app.ctx.front = None
    app.ctx.created = int(time.time())   # /v1/models' `created`
    app.ctx.config_hash = config_hash(cfg)
    app.ctx.record = base_record(cfg, app.ctx.config_hash, None)
    if app.ctx.pool is not None:   # what the server answers itself (a 401, a 404) names the pool
        app.ctx.record = dataclasses.replace(app.ctx.record, model=",".join(app.ctx.pool.ids))
    adm = cfg.admission
    metrics.queue_capacity.set(adm.max_queue)
    metrics.memory_budget.set(adm.memory_budget_gb * 1e9 if adm.memory_budget_gb is not None
                              else float("nan"))
    app.ctx.responses = ResponseStore(cfg.server.responses_ttl_s,
                                      int(cfg.server.responses_store_mb * 1_000_000))
    app.ctx.background = {}   # running background responses (responses_background.py)
    # their state on disk, resumed by the next launch; the key of this process's own
    # resubmissions (background_resume.py)
    app.ctx.background_store = BackgroundStore(Path(cfg.server.files_dir).expanduser())
    app.ctx.internal_key = secrets.token_urlsafe(24)
    app.ctx.resume_task = None
    app.ctx.warmup = Warmup(cfg.cache.warmup_budget_tokens, metrics) \
        if cfg.cache.warmup_budget_tokens and cfg.cache.name != "off" else None
    app.ctx.streams = StreamStore(cfg.server.stream_resume_s,
                                  int(cfg.server.stream_resume_mb * 1_000_000), metrics)

    startup.add_startup(app, cfg, engine, metrics)
    drain.add_drain(app, cfg, engine, metrics)
    add_middleware(app, cfg)
    add_error_handlers(app, cfg)
    _add_routes(app)
    batch_routes.add_routes(app)   # /v1/files, /v1/batches
    add_chat_page(app, cfg.server.chat_page)
    return app


def _engine(cfg: ServeConfig, pool: Any, metrics: Metrics) -> EngineClient:
    """The engine cfg names: a pool's, an embedding model's, or the generation engine."""
    if pool is not None:
        return PoolEngine(pool, metrics)
    if cfg.model.encoder:   # an embedding or reranking model (pipeserve/embed/engine.py)
        return EmbedEngine(cfg, metrics)
    return Engine(cfg, metrics)


def _add_routes(app: Sanic) -> None:
    _admin = partial(require_admin, app)

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
        _admin(http)
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

    @app.get("/v1/adapters")
    async def adapters(http: sanic.Request) -> HTTPResponse:
        """The mounted adapters (at launch: model.adapter and model.adapters; at runtime:
        POST /v1/adapters); the launch default (what requests naming none run with) has
        `default: true`. A pool lists every member's (each entry names its `model`), as
        last loaded; one model in its own process (server.isolate=true) lists as in-process."""
        pool = app.ctx.pool
        if pool is not None and not pool.single:
            return json_response({"object": "list", "data": [
                {**entry, "model": m.id} for m in pool.members.values()
                for entry in _mounted(m.engine.limits if m.engine is not None else None)]})
        engine = app.ctx.engine if pool is None else pool.members[pool.default_id].engine
        limits = engine.limits if engine is not None else None
        if limits is None:
            raise EngineUnavailable("the model is still loading; retry after Retry-After seconds")
        return json_response({"object": "list", "data": _mounted(limits)})

    def _mounted(limits: Any) -> list[dict[str, object]]:
        set_ = limits.adapters if limits is not None else None
        return ([{**a.describe(), "default": a.id == set_.default}
                 for a in set_.adapters.values()] if set_ is not None else [])

    scripting_routes.add_routes(app, _admin)   # models, tokenizer, embeddings, rerank

    async def _swap(model: Any, adapter_id: str, mount: bool) -> dict[str, object]:
        """Hot-swap (pipeserve/adapters/swap.py): the engine thread mounts or unmounts between
        steps; this handler only awaits its reply. Under a pool (or server.isolate=true) the
        command crosses to the engine process of the member `model` names (the default one
        when it names none), loaded first."""
        pool = app.ctx.pool
        engine = app.ctx.engine if pool is None else (await pool.context(model)).engine
        return await adapter_swap.request(engine, AdapterSwap(adapter_id, mount))

    @app.post("/v1/adapters")
    async def mount_adapter(http: sanic.Request) -> HTTPResponse:
        """Mount model.adapter_dir/<id> at runtime: 200 with its /v1/adapters entry; 400 (not
        an id, a path out of the directory, files that do not fit the base model, DoRA), 404
        (no such subdirectory), 409 (already mounted). Needs server.admin_key when set.
        Under a pool, `model` names the member."""
        _admin(http)
        body = read_body(http)
        if not isinstance(body.get("id"), str):
            raise InvalidRequest('the body must be a JSON object {"id": "<subdirectory of '
                                 'model.adapter_dir>"}', param="id")
        return json_response(await _swap(body.get("model"), body["id"], True))

    @app.delete("/v1/adapters/<adapter_id:str>")
    async def unmount_adapter(http: sanic.Request, adapter_id: str) -> HTTPResponse:
        """Unmount: 200 with the entry it had, `deleted: true`; 404 when not mounted; 409 for
        the launch default or while running or waiting requests use it (the count named).
        Under a pool, `?model=` names the member."""
        _admin(http)
        return json_response({**await _swap(http.args.get("model"), adapter_id, False),
                              "deleted": True})

    @app.post("/v1/chat/completions")
    async def chat(http: sanic.Request) -> HTTPResponse | None:
        return await openai_http.handle(app, http, "chat")

    @app.post("/v1/completions")
    async def completions(http: sanic.Request) -> HTTPResponse | None:
        return await openai_http.handle(app, http, "completions")

    @app.post("/v1/messages")
    async def messages(http: sanic.Request) -> HTTPResponse | None:
        return await anthropic.handle_messages(app, http)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(http: sanic.Request) -> HTTPResponse:
        return await anthropic.handle_count_tokens(app, http)

    @app.post("/v1/responses")
    async def create_response(http: sanic.Request) -> HTTPResponse | None:
        return await responses.handle_create(app, http)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(http: sanic.Request) -> HTTPResponse:
        return await responses.handle_input_tokens(app, http)

    @app.get("/v1/streams/<stream_id:str>")
    async def resume_stream(http: sanic.Request, stream_id: str) -> None:
        """Replay a stream's frames after Last-Event-ID (or ?after=N), then follow it live."""
        await resume.resume(http, app.ctx.streams, stream_id, app.ctx.cfg.server.keep_alive_s)

    @app.get("/v1/responses/<response_id:str>")
    async def get_response(http: sanic.Request, response_id: str) -> HTTPResponse | None:
        return await responses.handle_get(app, http, response_id)

    @app.post("/v1/responses/<response_id:str>/cancel")
    async def cancel_response(http: sanic.Request, response_id: str) -> HTTPResponse:
        return await responses_background.cancel(app, response_id)

    @app.delete("/v1/responses/<response_id:str>")
    async def delete_response(http: sanic.Request, response_id: str) -> HTTPResponse:
        return await responses.handle_delete(app, http, response_id)
