"""build_app(cfg): the Sanic app — routes, auth, errors, metrics endpoint — around one Engine.
Handlers run on the event loop and never call MLX; the engine thread does."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, AsyncIterator

import orjson
import sanic
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sanic import HTTPResponse, Sanic
from sanic.exceptions import SanicException

from pipeline.api import openai as oa
from pipeline.config import ServeConfig, build, config_hash
from pipeline.engine import Engine, EngineState
from pipeline.errors import (AdmissionRejected, EngineUnavailable, InvalidRequest, ServeError,
                             Unauthorized)
from pipeline.events import Failed, Finished, TokenDelta
from pipeline.metrics import Metrics
from pipeline.request import FinishReason, Request, TokenLogprob
from pipeline.stream import RequestStream

log = logging.getLogger("pipeserve")


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "unknown"


class Front:
    """The request stages, built once the model (and so the tokenizer) is loaded."""

    def __init__(self, cfg: ServeConfig, engine: Engine) -> None:
        assert engine.loaded is not None
        loaded = engine.loaded
        self.tokenize = build(cfg.pipeline.tokenize._target_, cfg, loaded)
        self.admission = build(cfg.admission._target_, cfg, loaded, engine)
        self.detokenize = build(cfg.pipeline.detokenize._target_, cfg, loaded)

    async def prepare(self, request: Request) -> Request:
        request = await self.tokenize(request)
        return await self.admission(request)

    def token_info(self, token_id: int) -> tuple[str, bytes]:
        raw = self.detokenize.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw


@dataclass
class Generation:
    """One submitted request seen from the event loop: text pieces, then finish + usage."""

    app_ctx: Any
    request: Request
    stream: RequestStream
    finish_reason: str = "stop"
    usage: oa.Usage = field(default_factory=oa.Usage)
    all_logprobs: list[TokenLogprob] = field(default_factory=list)

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenLogprob] | None]]:
        ctx, req = self.app_ctx, self.request
        text = ctx.front.detokenize.open(req.sampling.stop)
        self.usage.prompt_tokens = req.num_prompt_tokens
        keep_alive = ctx.cfg.server.keep_alive_s
        while True:
            try:
                event = await asyncio.wait_for(self.stream.next(), keep_alive)
            except asyncio.TimeoutError:
                yield "", None   # lets a streaming caller send a keep-alive comment
                continue
            if isinstance(event, TokenDelta):
                self.usage.completion_tokens += len(event.token_ids)
                piece = text.feed(event.token_ids)
                if event.logprobs:
                    self.all_logprobs.extend(event.logprobs)
                if text.stopped:
                    ctx.engine.abort(req.request_id)
                    self.finish_reason = "stop"
                    yield piece, event.logprobs
                    return
                if piece or event.logprobs:
                    yield piece, event.logprobs
            elif isinstance(event, Finished):
                self.usage.cached_tokens = event.num_cached_tokens
                self.finish_reason = ("length" if event.reason is FinishReason.LENGTH else "stop")
                tail = text.finish()
                if tail:
                    yield tail, None
                return
            else:
                assert isinstance(event, Failed)
                raise event.error


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> HTTPResponse:
    return HTTPResponse(orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")


def _sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def build_app(cfg: ServeConfig, *, name: str = "pipeserve") -> Sanic:
    app = Sanic(name, configure_logging=False)
    app.config.REQUEST_MAX_SIZE = int(cfg.server.max_body_mb * 1_000_000)
    app.config.RESPONSE_TIMEOUT = 24 * 3600
    app.config.REQUEST_TIMEOUT = 600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    engine = Engine(cfg, metrics)
    app.ctx.cfg, app.ctx.metrics, app.ctx.registry, app.ctx.engine = cfg, metrics, registry, engine
    app.ctx.front = None
    app.ctx.config_hash = config_hash(cfg)

    @app.before_server_start
    async def _start(app: Sanic) -> None:
        engine.start()

    @app.after_server_start
    async def _wait_ready(app: Sanic) -> None:
        async def wait() -> None:
            ok = await asyncio.get_running_loop().run_in_executor(None, engine.wait_ready)
            if not ok:
                log.error("engine failed to start: %r; stopping", engine.startup_error)
                app.ctx.exit_code = 1
                app.stop()
                return
            app.ctx.front = Front(cfg, engine)
            loaded = engine.loaded
            metrics.build.info({
                "version": _version("pipeserve"), "mlx_version": _version("mlx"),
                "device": engine.device, "model": cfg.model.name,
                "model_fingerprint": loaded.fingerprint, "config_hash": app.ctx.config_hash})
            log.info("ready: model %s (%d params) on %s, listening on %s:%d", cfg.model.name,
                     loaded.num_params, engine.device, cfg.server.host, cfg.server.port)
        app.add_task(wait())

    @app.after_server_stop
    async def _stop(app: Sanic) -> None:
        engine.stop()

    _add_middleware(app, cfg)
    _add_routes(app)
    return app


def _add_middleware(app: Sanic, cfg: ServeConfig) -> None:
    origins = cfg.server.cors_origins

    @app.on_request
    async def _auth(http: sanic.Request) -> HTTPResponse | None:
        if origins and http.method == "OPTIONS":
            return HTTPResponse(status=204)
        key = cfg.server.api_key
        if key and http.path.startswith("/v1/"):
            auth = http.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else http.headers.get("x-api-key")
            if given != key:
                raise Unauthorized("invalid or missing API key; send Authorization: Bearer <key>")
        return None

    if origins:
        @app.on_response
        async def _cors(http: sanic.Request, response: HTTPResponse) -> None:
            origin = http.headers.get("origin")
            if origin and ("*" in origins or origin in origins):
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Allow-Headers"] = "authorization, content-type, x-api-key"
                response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"

    @app.exception(ServeError)
    async def _serve_error(http: sanic.Request, e: ServeError) -> HTTPResponse:
        headers = {"Retry-After": str(e.retry_after_s)} if isinstance(e, AdmissionRejected) else None
        return _json(oa.error_body(e.message, e.error_type, e.param, e.code), e.status, headers)

    @app.exception(SanicException)
    async def _sanic_error(http: sanic.Request, e: SanicException) -> HTTPResponse:
        status = getattr(e, "status_code", 500) or 500
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
        message = str(e)
        if status == 413:
            message = f"request body is larger than server.max_body_mb ({cfg.server.max_body_mb} MB)"
        return _json(oa.error_body(message, kind, None, None), status)

    @app.exception(Exception)
    async def _fault(http: sanic.Request, e: Exception) -> HTTPResponse:
        log.exception("unhandled error on %s %s", http.method, http.path)
        return _json(oa.error_body(f"internal error: {e!r}", "server_error", None, None), 500)


def _body(http: sanic.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(http.body or b"")
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _ready_front(app: Sanic) -> Front:
    engine: Engine = app.ctx.engine
    if engine.state is not EngineState.READY or app.ctx.front is None:
        raise EngineUnavailable(f"the engine is {engine.state.value}; retry when /health is 200")
    return app.ctx.front


def _add_routes(app: Sanic) -> None:
    @app.get("/health")
    async def health(http: sanic.Request) -> HTTPResponse:
        engine: Engine = app.ctx.engine
        ready = engine.state is EngineState.READY and app.ctx.front is not None
        state = "ok" if ready else engine.state.value
        return _json({"status": state, "model": app.ctx.cfg.model.name,
                      "waiting": engine.num_waiting, "inflight": engine.num_inflight},
                     200 if ready else 503)

    @app.get("/metrics")
    async def metrics(http: sanic.Request) -> HTTPResponse:
        return HTTPResponse(generate_latest(app.ctx.registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(http: sanic.Request) -> HTTPResponse:
        name = app.ctx.cfg.model.name
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pipeserve"}]})

    @app.post("/v1/chat/completions")
    async def chat(http: sanic.Request) -> HTTPResponse | None:
        return await _generate(app, http, "chat")

    @app.post("/v1/completions")
    async def completions(http: sanic.Request) -> HTTPResponse | None:
        return await _generate(app, http, "completions")


async def _generate(app: Sanic, http: sanic.Request, endpoint: str) -> HTTPResponse | None:
    ctx = app.ctx
    t0 = time.perf_counter()
    outcome = "error"
    req: Request | None = None
    gen: Generation | None = None
    try:
        front = _ready_front(app)
        body = _body(http)
        parsed = oa.parse_chat(body) if endpoint == "chat" else oa.parse_completion(body)
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        req = Request(request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint,
                      inputs=parsed.inputs, requested=parsed.requested)
        req = await front.prepare(req)
        stream = RequestStream(asyncio.get_running_loop())
        ctx.engine.submit(req, stream)
        gen = Generation(ctx, req, stream)
        fp = f"fp_{ctx.config_hash}"
        shape = (oa.ChatShape(req.request_id, ctx.cfg.model.name, front.token_info, fp)
                 if endpoint == "chat" else
                 oa.CompletionShape(req.request_id, ctx.cfg.model.name, front.token_info, fp))
        if parsed.stream:
            await _stream(http, gen, shape, parsed, endpoint)
            outcome = "ok"
            return None
        prompt_text = ""
        if parsed.echo:
            prompt_text = front.detokenize.decode(req.prompt_ids)
        text = prompt_text + "".join([piece async for piece, _ in gen.pieces()])
        lps = gen.all_logprobs if req.sampling.logprobs else None
        outcome = "ok"
        return _json(shape.body(text, gen.finish_reason, lps, gen.usage))
    except InvalidRequest:
        outcome = "invalid"
        raise
    except AdmissionRejected:
        outcome = "rejected"
        raise
    except asyncio.CancelledError:
        outcome = "cancelled"
        if gen is not None:
            gen.finish_reason = "abort"
        raise
    finally:
        if gen is not None and not gen.stream.finished and req is not None:
            ctx.engine.abort(req.request_id)   # client left, stop string, or an error
        ctx.metrics.requests.labels(endpoint, outcome).inc()
        if req is not None and gen is not None:
            elapsed = time.perf_counter() - t0
            ctx.metrics.e2e.observe(elapsed)
            log.info("request %s endpoint=%s prompt=%d generated=%d finish=%s outcome=%s "
                     "total_s=%.3f", req.request_id, endpoint, req.num_prompt_tokens,
                     gen.usage.completion_tokens, gen.finish_reason, outcome, elapsed)


async def _stream(http: sanic.Request, gen: Generation, shape: Any, parsed: oa.Parsed,
                  endpoint: str) -> None:
    response = await http.respond(content_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if endpoint == "chat":
        await response.send(_sse(shape.chunk({"role": "assistant", "content": ""})))
    try:
        async for piece, lps in gen.pieces():
            if not piece and not lps:
                await response.send(b": keep-alive\n\n")
                continue
            if endpoint == "chat":
                await response.send(_sse(shape.chunk({"content": piece}, lps=lps)))
            else:
                await response.send(_sse(shape.chunk(piece, lps=lps)))
    except ServeError as e:
        await response.send(_sse(oa.error_body(e.message, e.error_type, e.param, e.code)))
        await response.send(b"data: [DONE]\n\n")
        await response.eof()
        return
    usage = gen.usage
    final_usage = None if parsed.include_usage else usage
    if endpoint == "chat":
        await response.send(_sse(shape.chunk({}, gen.finish_reason, usage=final_usage)))
    else:
        await response.send(_sse(shape.chunk("", gen.finish_reason, usage=final_usage)))
    if parsed.include_usage:
        await response.send(_sse(shape.usage_chunk(usage)))
    await response.send(b"data: [DONE]\n\n")
    await response.eof()
