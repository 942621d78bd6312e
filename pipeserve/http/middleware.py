"""What runs around every request: the key and drain guard before the route, the record,
warning and CORS headers after it. Event loop."""
from __future__ import annotations

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.config import ServeConfig
from pipeserve.errors import EngineUnavailable, Unauthorized
from pipeserve.http.api.known_fields import HEADER as IGNORED_HEADER
from pipeserve.http.api.record import HEADER as RECORD_HEADER
from pipeserve.http.api.volatile import HEADER as VOLATILE_HEADER
from pipeserve.http.keys import key_ok

WARNING_HEADER = "x-pipeserve-warning"
# Paths outside /v1/ that the API key guards and a drain closes, as /v1/ (vLLM's tokenizer routes)
API_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/rerank", "/v2/rerank")


def _api_path(path: str) -> bool:
    return path.startswith("/v1/") or path in API_PATHS


def route_path(http: sanic.Request) -> str:
    """The path of the route a request matched, as declared ("/tokenize", "/v1/models/<target:path>"):
    one rule whatever slashes the client sent (Sanic routes "/tokenize/" to "/tokenize")."""
    route = http.route
    return "/" + route.path.strip("/") if route is not None else http.path


def add_middleware(app: Sanic, cfg: ServeConfig) -> None:
    _add_guard(app, cfg)
    _add_headers(app, cfg.server.cors_origins)


def _add_guard(app: Sanic, cfg: ServeConfig) -> None:
    """Before the route: the API key (the admin key where the route takes it instead) and,
    while draining, a 503 for API paths."""
    origins = cfg.server.cors_origins

    @app.on_request
    async def _auth(http: sanic.Request) -> HTTPResponse | None:
        if origins and http.method == "OPTIONS":
            return HTTPResponse(status=204)
        key = cfg.server.api_key
        path = route_path(http)
        # POST/DELETE /v1/adapters and POST /v1/models/... (load, unload, rescan) take the
        # admin key instead, when one is set (their handlers check it)
        swap = (http.method in ("POST", "DELETE") and bool(cfg.server.admin_key)
                and (path == "/v1/adapters" or path.startswith("/v1/adapters/")
                     or (http.method == "POST" and path.startswith("/v1/models/"))))
        # priorities more urgent than the default class are granted to the admin key only,
        # when one is set (pipeserve/http/api/http.py checks the request's)
        http.ctx.urgent_ok = bool(cfg.server.admin_key) and key_ok(http, cfg.server.admin_key)
        if key and _api_path(path) and not swap:
            if not key_ok(http, key) and not http.ctx.urgent_ok:   # the admin key: all of it
                raise Unauthorized("invalid or missing API key; send Authorization: Bearer <key> "
                                   "or x-api-key: <key>")
        if app.ctx.draining and _api_path(path):
            if http.stream is not None:
                http.stream.keep_alive = False
            raise EngineUnavailable("the server is shutting down; retry after Retry-After "
                                    "seconds or send this request elsewhere")
        return None


def _add_headers(app: Sanic, origins: list[str]) -> None:
    """After the route: what the response ran under, what the request asked and was ignored,
    and the CORS headers for an allowed origin."""
    @app.on_response
    async def _record(http: sanic.Request, response: HTTPResponse) -> None:
        """Every /v1/ response names what it ran under; a generation's own record (with its
        batch size) once it has one, else the server's (stream headers go out before it)."""
        if http.path.startswith("/v1/") and RECORD_HEADER not in response.headers:
            gen = getattr(http.ctx, "generation", None)
            record = gen.record if gen is not None and gen.record is not None else app.ctx.record
            response.headers[RECORD_HEADER] = record.header()
            if gen is not None and gen.request.warnings:   # what the request asked and was ignored
                response.headers[WARNING_HEADER] = " | ".join(gen.request.warnings)
            if gen is not None and gen.request.volatile:   # spans removed before tokenize
                response.headers[VOLATILE_HEADER] = ", ".join(gen.request.volatile)

    @app.on_response
    async def _ignored(http: sanic.Request, response: HTTPResponse) -> None:
        names = getattr(http.ctx, "ignored", None)   # pipeserve/http/api/known_fields.py
        if names:
            response.headers[IGNORED_HEADER] = names

    if origins:
        @app.on_response
        async def _cors(http: sanic.Request, response: HTTPResponse) -> None:
            origin = http.headers.get("origin")
            if origin and ("*" in origins or origin in origins):
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Allow-Headers"] = (
                    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta")
                response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
                response.headers["Access-Control-Expose-Headers"] = (
                    f"{RECORD_HEADER}, {IGNORED_HEADER}, {WARNING_HEADER}, {VOLATILE_HEADER}")
