"""Error types of the framework and the HTTP status each maps to. Any thread."""
from __future__ import annotations

import logging


def check_positive(name: str, value: float | int | None, *, allow_none: bool = True) -> None:
    """Launch-time check for config fields: raise ConfigError unless `value` is > 0."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


log = logging.getLogger(__name__)

class ConfigError(ValueError):
    """A config value that cannot work; raised at launch, before any model load."""


class ServeError(Exception):
    """Base of the errors a request can end with; carries its HTTP status and type."""

    status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(ServeError):
    """Bad input: a field of the wrong type, out of range, or too large (400)."""

    status = 400
    error_type = "invalid_request_error"


class MemoryAdmissionError(InvalidRequest):
    """The request cannot fit the enforced memory or KV budget (400)."""

    error_type = "memory_admission"


class Unauthorized(ServeError):
    status = 401
    error_type = "authentication_error"


class NotFound(ServeError):
    status = 404
    error_type = "not_found_error"


class PayloadTooLarge(ServeError):
    status = 413
    error_type = "invalid_request_error"


class AdmissionRejected(ServeError):
    """The server cannot take the request now (429); `retry_after_s` tells when to retry."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class EngineUnavailable(ServeError):
    """The engine is loading, draining or dead (503)."""

    status = 503
    error_type = "service_unavailable"


class StageError(ServeError):
    """A fault inside a step stage; fails that step's requests (500)."""

    status = 500
    error_type = "server_error"

    def __init__(self, stage: str, request_ids: list[str], cause: BaseException) -> None:
        # the cause goes to the server log, never to a client
        super().__init__(f"internal error in the {stage} stage (request "
                         f"{', '.join(request_ids)}); the server log has the details")
        self.stage = stage
        self.request_ids = request_ids


def row_failure(request_id: str, cause: BaseException) -> ServeError:
    """What the client of a row that failed on its own hears: the stage's own client-facing
    reason (a grammar that broke), else a 500 that points at the log (where the cause goes)."""
    if isinstance(cause, ServeError):
        log.warning("request %s failed in its step: %s", request_id, cause.message)
        return cause
    log.error("request %s failed in its step", request_id, exc_info=cause)
    return StageError("step", [request_id], cause)


def step_failed(request_id: str) -> EngineUnavailable:
    return EngineUnavailable(
        f"the engine step computing request {request_id} failed (an internal error, logged "
        "by the server); nothing after the tokens already sent was produced — retry the "
        "request", code="step_failed")
