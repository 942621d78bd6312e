"""Exceptions → error responses in the shape of the protocol the route speaks (OpenAI's, or
Anthropic's under /v1/messages). Event loop."""
from __future__ import annotations

import logging

import sanic
from sanic import HTTPResponse, Sanic
from sanic.exceptions import SanicException

from pipeserve.config import ServeConfig
from pipeserve.errors import AdmissionRejected, EngineUnavailable, ServeError
from pipeserve.http.api import anthropic
from pipeserve.http.api import openai as oa
from pipeserve.http.api.http import json_response

log = logging.getLogger("pipeserve")
RETRY_AFTER_S = 5   # Retry-After of a 503 (loading, or draining: a restart or another replica)


def _error(http: sanic.Request, message: str, error_type: str, param: str | None,
           code: str | None, status: int, headers: dict[str, str] | None = None) -> HTTPResponse:
    """An error in the shape of the protocol the route speaks (Anthropic under /v1/messages)."""
    if http.path.startswith("/v1/messages"):
        return json_response(anthropic.error_body(message, error_type, status, code), status,
                             headers)
    return json_response(oa.error_body(message, error_type, param, code), status, headers)


def add_error_handlers(app: Sanic, cfg: ServeConfig) -> None:
    @app.exception(ServeError)
    async def _serve_error(http: sanic.Request, e: ServeError) -> HTTPResponse:
        headers = ({"Retry-After": str(e.retry_after_s)} if isinstance(e, AdmissionRejected)
                   else {"Retry-After": str(RETRY_AFTER_S)} if isinstance(e, EngineUnavailable)
                   else None)
        return _error(http, e.message, e.error_type, e.param, e.code, e.status, headers)

    @app.exception(SanicException)
    async def _sanic_error(http: sanic.Request, e: SanicException) -> HTTPResponse:
        status = getattr(e, "status_code", 500) or 500
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
        message = str(e)
        if status == 413:
            message = f"request body is larger than server.max_body_mb ({cfg.server.max_body_mb} MB)"
        return _error(http, message, kind, None, None, status)

    @app.exception(Exception)
    async def _fault(http: sanic.Request, e: Exception) -> HTTPResponse:
        # the exception goes to the log only; the client gets an id to quote
        gen = getattr(http.ctx, "generation", None)
        rid = gen.request.request_id if gen is not None else f"req_{http.id}"
        log.exception("unhandled error on %s %s (request %s)", http.method, http.path, rid)
        return _error(http, f"internal error (request {rid}); the server log has the details",
                      "server_error", None, None, 500)
