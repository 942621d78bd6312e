"""HTTP plumbing shared by the protocol adapters: JSON and SSE bodies, the request body, the
ready check, and `Scope`, the bookkeeping of one generation request (outcome metric,
latency, log line, abort when the client leaves). Event loop."""
from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType
from dataclasses import replace
from typing import Any

import orjson
import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api.generation import Generation
from pipeserve.core.client import EngineState
from pipeserve.errors import (AdmissionRejected, EngineUnavailable, InvalidRequest, NotFound,
                             ServeError)
from pipeserve.eventloop.latency import priority_of
from pipeserve.eventloop.offload import PAUSE_GC_BYTES, gc_paused
from pipeserve.request import Request
from pipeserve.core.stream import RequestStream
from pipeserve.embed.engine import NOT_GENERATIVE
from pipeserve.http.api import json_body
from pipeserve.http.api.fields import keep_alive

log = logging.getLogger("pipeserve")
PRIORITY_HEADER = "x-pipeserve-priority"   # a request's priority class, as the body's field


def json_response(body: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> HTTPResponse:
    return HTTPResponse(orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")


def sse_data(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def sse_event(name: str, body: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def read_body(http: sanic.Request) -> dict[str, Any]:
    try:
        body = json_body.loads(http.body or b"")
    except json_body.JSONError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def ready_front(app: Sanic, ctx: Any = None) -> Any:
    """The request stages (server.Front) once the engine is ready; else 503. `ctx`: a pool
    member's context (pipeserve/pool/pool.py Member); the app's own by default."""
    ctx = app.ctx if ctx is None else ctx
    engine = ctx.engine
    if getattr(app.ctx, "draining", False):
        raise EngineUnavailable("the server is shutting down; send this request elsewhere")
    if getattr(app.ctx, "pool", None) is not None and ctx is app.ctx:
        raise EngineUnavailable("this request was not routed to a pool model")
    if ctx.cfg.model.encoder:
        raise InvalidRequest(f"model {ctx.cfg.model.name!r}: {NOT_GENERATIVE}", param="model",
                             code="embedding_model")
    if engine.state is not EngineState.READY or ctx.front is None:
        raise EngineUnavailable(f"the engine is {engine.state.value}; retry when /health is 200")
    return ctx.front


def check_ready(app: Sanic) -> None:
    """One model: a 503 at once while it loads, before the body is read. A pool checks the
    model a request names once it is routed (Scope.route)."""
    if getattr(app.ctx, "pool", None) is None:
        ready_front(app)


async def route(app: Sanic, body: dict[str, Any], pin: bool = False) -> Any:
    """The context a request runs in: the app's, or under pool=... the member its `model`
    names, loaded (a 404 listing the ids for an unknown one; waits while it loads). `pin`:
    the member stays loaded until its `release()` (a generation's Scope does that)."""
    pool = getattr(app.ctx, "pool", None)
    if pool is None:
        keep_alive(body)   # checked, so a bad value is a 400 here too; one model stays loaded
        return app.ctx
    return await pool.context(body.get("model"), pin=pin, keep_alive=keep_alive(body))


class Scope:
    """`async with Scope(app, "chat", http) as scope:` around one generation request. `start`
    runs the request stages and submits; leaving the block settles the outcome metric,
    the latency histogram and the log line, and aborts a generation still running."""

    def __init__(self, app: Sanic, endpoint: str, http: sanic.Request) -> None:
        self.app, self.endpoint, self.http = app, endpoint, http
        self.ctx = app.ctx
        self.t0 = time.perf_counter()
        self.request: Request | None = None
        self.gen: Generation | None = None
        self.more: list[Generation] = []   # choices 1.. of an n > 1 request
        self.prepared: list[Request] = []   # every request admission passed
        self.failed = False   # a stream that ended with an error event
        self.pinned: Any = None   # the pool member routed to, released on exit
        # a large body: the cyclic GC stays off from here until its request is prepared
        # (parse, validation, template, tokens: pipeserve/eventloop/offload.py says why)
        self._gc: gc_paused | None = None
        if len(http.body or b"") > PAUSE_GC_BYTES:
            self._gc = gc_paused()
            self._gc.__enter__()
        self.detached: asyncio.Task[Any] | None = None   # a resumable stream left by its client

    async def route(self, body: dict[str, Any]) -> Any:
        """Route by the body's `model` (a pool; pipeserve/pool/) and return the request
        stages: from here on `self.ctx` is the model's context (engine, front, cfg, metrics)."""
        self.ctx = await route(self.app, body, pin=True)
        self.pinned = self.ctx if self.ctx is not self.app.ctx else None
        return ready_front(self.app, self.ctx)

    def _check_priority(self, request: Request) -> None:
        """A priority more urgent than admission.default_priority is the admin key's to ask
        for (when server.admin_key is set): a client cannot push every other one back."""
        value = request.requested.priority
        if (value is None or not self.ctx.cfg.server.admin_key
                or getattr(self.http.ctx, "urgent_ok", False)):
            return
        admission = self.ctx.cfg.admission
        asked, _ = priority_of(value, admission.priority_classes, admission.default_priority)
        default = admission.priority_classes[admission.default_priority]
        if asked < default:
            raise InvalidRequest(
                f"priority {value!r:.20} is more urgent than the default class "
                f"{admission.default_priority!r} ({default}); only requests with "
                "server.admin_key may ask for it — send the default or a later class",
                param="priority", code="priority_not_granted")

    async def start(self, request: Request, parse_output: bool = True) -> Generation:
        return self.submit(await self.prepare(request), parse_output)

    async def prepare(self, request: Request) -> Request:
        """The request stages (tokenize, admission); `submit` sends the result to the engine."""
        asked = self.http.headers.get(PRIORITY_HEADER)   # a body's own `priority` wins
        if asked is not None and request.requested.priority is None:
            request.requested = replace(request.requested, priority=asked)
        self._check_priority(request)
        try:
            request = await ready_front(self.app, self.ctx).prepare(request)
        finally:
            self._resume_gc()
        self.prepared.append(request)
        if self.request is None:
            self.request = request
        return request

    def _resume_gc(self) -> None:
        if self._gc is not None:
            self._gc.__exit__(None, None, None)
            self._gc = None

    def submit(self, request: Request, parse_output: bool = True) -> Generation:
        warmup = getattr(self.app.ctx, "warmup", None)
        if warmup is not None:
            warmup.cancel_all()   # real work: warm-ups stop at the next step boundary
        stream = RequestStream(asyncio.get_running_loop())
        self.ctx.engine.submit(request, stream)
        gen = Generation(self.ctx, request, stream, parse_output)
        if self.gen is None:
            self.gen = gen
            self.http.ctx.generation = gen   # its record goes into the response header
        else:
            self.more.append(gen)
        return gen

    async def __aenter__(self) -> Scope:
        return self

    def detach(self, task: asyncio.Task[Any]) -> None:
        """A resumable stream's client left (pipeserve/http/api/resume.py): its producer `task` runs
        on, and the request settles (abort, outcome metric, log line) when the task ends."""
        self.detached = task

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._resume_gc()
        task = self.detached
        if task is not None and not task.done():
            task.add_done_callback(lambda t: self._settle(
                asyncio.CancelledError() if t.cancelled() else t.exception()))
            return False
        self._settle(exc)
        return False

    def _settle(self, exc: BaseException | None) -> None:
        outcome = self._outcome(exc)
        if self.pinned is not None:
            self.pinned.release()
        gen, req = self.gen, self.request
        for g in ([gen] if gen is not None else []) + self.more:
            if not g.stream.finished:
                self.ctx.engine.abort(g.request.request_id)   # client left, stop, or an error
        self.ctx.metrics.requests.labels(self.endpoint, outcome).inc()
        elapsed = time.perf_counter() - self.t0
        self._measure(outcome, elapsed)
        warmup = getattr(self.app.ctx, "warmup", None)
        if warmup is not None and outcome == "ok" and gen is not None and not self.more:
            warmup.after_turn(self.ctx, gen)
        if req is not None and gen is not None:
            if outcome == "cancelled":
                gen.finish_reason = "abort"
            self.ctx.metrics.e2e.observe(elapsed)
        self._log(outcome, elapsed, exc)
        if getattr(self.ctx, "draining", False) and self.http.stream is not None:
            # shutting down: close this connection after the response instead of keeping it
            # alive, so the graceful shutdown does not wait for idle keep-alive sockets
            self.http.stream.keep_alive = False

    def _measure(self, outcome: str, elapsed: float) -> None:
        """Feed admission's latency estimator (pipeserve/eventloop/latency.py) with what each generation
        took, and the queue-wait and estimate-error metrics."""
        front = getattr(self.ctx, "front", None)
        latency = getattr(getattr(front, "admission", None), "latency", None)
        if latency is None:
            return
        now = time.perf_counter()
        metrics = self.ctx.metrics
        for g in ([self.gen] if self.gen is not None else []) + self.more:
            rid = g.request.request_id
            wait = g.engine_extras.get("queue_wait_s")
            if outcome != "ok" or not isinstance(wait, float):
                latency.forget(rid)
                continue
            metrics.queue_wait.labels(g.request.priority_class).observe(wait)
            first = g.first_token_s
            ratio = latency.finish(
                rid, g.usage.prompt_tokens - g.usage.cached_tokens,
                g.usage.completion_tokens,
                prefill_s=first - self.t0 - wait if first is not None else None,
                decode_s=now - first if first is not None else None,
                queue_s=wait, e2e_s=elapsed)
            if ratio is not None:
                metrics.estimate_error.observe(ratio)
        for req in self.prepared:   # admitted, never submitted (a later choice failed)
            latency.forget(req.request_id)

    def _log(self, outcome: str, elapsed: float, exc: BaseException | None = None) -> None:
        """One line per request at INFO; its fields are also LogRecord attributes, so the
        JSON formatter (server.log_format=json) writes them as keys. A refused request's line
        ends with its status and the reason the client was given."""
        req, gen = self.request, self.gen
        ttft = gen.first_token_s - self.t0 if gen is not None and gen.first_token_s else None
        wait = gen.engine_extras.get("queue_wait_s") if gen is not None else None
        fields: dict[str, Any] = {
            "request_id": req.request_id if req is not None else None,
            "endpoint": self.endpoint, "outcome": outcome,
            # the client's prompt (the engine's grows by what a preemption or a resume folds in)
            "prompt_tokens": (gen.usage.prompt_tokens if gen is not None
                              else req.num_prompt_tokens if req is not None else None),
            "cached_tokens": gen.usage.cached_tokens if gen is not None else None,
            "generated_tokens": sum(g.usage.completion_tokens for g in [gen, *self.more])
                                if gen is not None else None,
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            # arrival until the scheduler gave it a row: ttft_s less this is its prefill's
            "queue_s": round(wait, 4) if isinstance(wait, float) else None,
            "total_s": round(elapsed, 4),
            "finish": gen.finish_reason if gen is not None else None}
        preempted = sum(_preemptions(g) for g in ([gen] if gen is not None else []) + self.more)
        if preempted:   # its row was taken by more urgent requests this often
            fields["preemptions"] = preempted
        if isinstance(exc, ServeError):
            fields["status"] = exc.status
            fields["reason"] = exc.message[:300]   # what the client's error body says
        text = " ".join(f"{k}={'-' if v is None else (repr(v) if k == 'reason' else v)}"
                        for k, v in fields.items() if k != "request_id")
        log.info("request %s %s", fields["request_id"] or "-", text,
                 extra={"event": "request", **fields})

    def _outcome(self, exc: BaseException | None) -> str:
        if exc is None:
            return "error" if self.failed else "ok"
        if isinstance(exc, (InvalidRequest, NotFound)):
            return "invalid"
        if isinstance(exc, AdmissionRejected):
            return "rejected"
        if isinstance(exc, asyncio.CancelledError):
            return "cancelled"
        return "error"


def _preemptions(gen: Generation) -> int:
    """Times the scheduler gave this generation's row to a more urgent request."""
    n = gen.engine_extras.get("preemptions")
    return n if isinstance(n, int) else 0
