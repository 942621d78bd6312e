"""build_app(cfg): the Sanic app around one Engine (or a pool's): its limits and context, and
the wiring of its lifecycle (startup.py, drain.py), middleware, error handlers and routes.
Handlers run on the event loop and never call MLX; the engine thread does."""
from __future__ import annotations

import dataclasses
import secrets
import time
from functools import partial
from pathlib import Path
from typing import Any

import sanic
from prometheus_client import CollectorRegistry
from sanic import HTTPResponse, Sanic
from sanic.server.protocols.http_protocol import HttpProtocol

from pipeserve.http.api import (adapter_routes, anthropic, openai_http, responses, resume,
                                scripting_routes)
from pipeserve.http.api import responses_background
from pipeserve.http.api.background_store import BackgroundStore
from pipeserve.http.api.record import base_record
from pipeserve.http.api.resume import StreamStore
from pipeserve.http.api.store import ResponseStore
from pipeserve.http.api.warmup import Warmup
from pipeserve.http.batch import routes as batch_routes
from pipeserve.http.chat_page import add_chat_page
from pipeserve.http import drain, ops_routes, startup
from pipeserve.http.error_handlers import add_error_handlers
from pipeserve.http.keys import require_admin
from pipeserve.http.middleware import add_middleware
from pipeserve.config import ServeConfig, config_hash
from pipeserve.core.client import EngineClient
from pipeserve.core.engine import Engine
from pipeserve.metrics import Metrics
from pipeserve.embed.engine import EmbedEngine
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
        engine = _engine(cfg, app, metrics)
    _context(app, cfg, engine, metrics, registry)
    startup.add_startup(app, cfg, engine, metrics)
    drain.add_drain(app, cfg, engine, metrics)
    add_middleware(app, cfg)
    add_error_handlers(app, cfg)
    _add_routes(app)
    batch_routes.add_routes(app)   # /v1/files, /v1/batches
    add_chat_page(app, cfg.server.chat_page)
    return app


class Protocol(HttpProtocol):
    """Sanic's HTTP protocol, telling the engine when a client opens a connection (its request
    is on its way: an idle engine gathering a burst waits for it; EngineClient.coming)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.app.ctx.engine.coming()


def _engine(cfg: ServeConfig, app: Sanic, metrics: Metrics) -> EngineClient:
    """The engine cfg names: a pool's, an embedding model's, or the generation engine (on a
    thread of this server: its death while serving stops the server, drain.py)."""
    if app.ctx.pool is not None:
        return PoolEngine(app.ctx.pool, metrics)
    if cfg.model.encoder:   # an embedding or reranking model (pipeserve/embed/engine.py)
        return EmbedEngine(cfg, metrics)
    died = drain.on_engine_death(app) if cfg.server.exit_on_engine_death else None
    return Engine(cfg, metrics, on_death=died)


def _context(app: Sanic, cfg: ServeConfig, engine: EngineClient, metrics: Metrics,
             registry: CollectorRegistry) -> None:
    """What the handlers share on app.ctx: the config, engine and metrics, the server's
    record, and the stores of responses, background responses and resumable streams."""
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


def _add_routes(app: Sanic) -> None:
    admin = partial(require_admin, app)
    ops_routes.add_routes(app, admin)   # HEAD probes, /health, /admin/cache/flush, /metrics
    adapter_routes.add_routes(app, admin)   # /v1/adapters
    scripting_routes.add_routes(app, admin)   # models, tokenizer, embeddings, rerank

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
