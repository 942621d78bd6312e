"""Anthropic routes: POST /v1/messages (a Message body, or its streaming event sequence:
message_start, content_block_*, message_delta, message_stop) and /v1/messages/count_tokens,
and errors in Anthropic's shape. The bodies are parsed in anthropic_request.py and shaped in
anthropic_shape.py. Event loop."""
from __future__ import annotations

import re
import uuid
from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.errors import ServeError
from pipeserve.eventloop.offload import off_loop
from pipeserve.http.api import fields as F
from pipeserve.http.api import known_fields, resume, structured
from pipeserve.http.api.anthropic_request import parse
from pipeserve.http.api.anthropic_shape import (BlockStream, message_body, stop_reason,
                                                usage_body, written)
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.http import (Scope, check_ready, json_response, read_body,
                                     ready_front, route, sse_event)
from pipeserve.http.api.resume import Frames, StreamLog
from pipeserve.request import Request

# HTTP status → Anthropic's error type: clients (Claude Code) pick their recovery by it
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}
# our context-limit messages (pipeserve/eventloop/encode.py, pipeserve/stages/admission.py) and
# Anthropic's own wording of the same, which Claude Code parses to compact or to retry with a
# smaller max_tokens
_PROMPT = re.compile(r"prompt has (\d+) tokens; the context limit is (\d+)")
_ROOM = re.compile(r"max_tokens is (\d+) but the prompt \((\d+) tokens\) leaves \d+ of the "
                   r"(\d+)-token context")


def error_body(message: str, error_type: str, status: int = 400,
               code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": _worded(message, code)}}


def _worded(message: str, code: str | None) -> str:
    """A context-limit error as Anthropic's API words it, ours after it."""
    if code != "context_length_exceeded":
        return message
    if m := _ROOM.search(message):
        asked, prompt, limit = m.groups()
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
                f"{limit}, decrease input length or `max_tokens` and try again ({message})")
    if m := _PROMPT.search(message):
        return f"prompt is too long: {m[1]} tokens > {m[2]} maximum ({message})"
    return message


async def handle_messages(app: Sanic, http: sanic.Request) -> HTTPResponse | None:
    async with Scope(app, "messages", http) as scope:
        check_ready(app)
        body = await off_loop(len(http.body or b""), read_body, http)
        known_fields.check(app.ctx, http, "messages", body)
        inputs, requested = await off_loop(len(http.body or b""), parse, body)
        await scope.route(body)
        ctx = scope.ctx
        req = Request(request_id=f"msg_{uuid.uuid4().hex}", endpoint="messages",
                      inputs=inputs, requested=requested,
                      constraint=structured.from_body(body, format_field=None),   # guided_*
                      adapter=F.adapter(body, ctx.cfg.model.name, ctx.engine.limits.adapters))
        keep = resume.resumable(body)
        gen = await scope.start(req)
        model = ctx.cfg.model.name
        if F.get(body, "stream", bool, False):
            async def produce(log: StreamLog) -> None:
                scope.failed = not await _stream(log, gen, model)
            await resume.serve(http, app.ctx.streams, req.request_id, keep,
                               ctx.cfg.server.keep_alive_s, produce, scope.detach)
            return None
        await gen.run()
        return json_response(message_body(gen.request.request_id, model, gen))


async def handle_count_tokens(app: Sanic, http: sanic.Request) -> HTTPResponse:
    check_ready(app)
    body = await off_loop(len(http.body or b""), read_body, http)
    known_fields.check(app.ctx, http, "count_tokens", body)
    inputs, _ = await off_loop(len(http.body or b""), lambda: parse(body, True))
    front = ready_front(app, await route(app, body))
    req = await front.tokenize(front.normalise(Request(
        request_id=f"count-{uuid.uuid4().hex}", endpoint="count_tokens", inputs=inputs)))
    return json_response({"input_tokens": req.num_prompt_tokens})


async def _stream(log: StreamLog, gen: Generation, model: str) -> bool:
    """Append the event sequence to `log`; False when it ended with an error event. Events
    wait while the generation's next event is already here and go out in one write
    (resume.Frames); the last write also ends the response body."""
    out = Frames(log, gen)

    def send(events: list[tuple[str, dict[str, Any]]]) -> None:
        for name, data in events:
            out.add(sse_event(name, data))

    start = {"id": gen.request.request_id, "type": "message", "role": "assistant",
             "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": usage_body(gen.usage, output=False, written=written(gen))}
    send([("message_start", {"type": "message_start", "message": start}),
          ("ping", {"type": "ping"})])
    await out.flush_unless_ready()
    blocks = BlockStream()
    try:
        async for delta in gen.deltas():
            send(blocks.events(delta) if delta else [("ping", {"type": "ping"})])
            await out.flush_unless_ready()
    except ServeError as e:
        send([("error", error_body(e.message, e.error_type, e.status, e.code))])
        await out.flush(last=True)
        return False
    reason, sequence = stop_reason(gen)
    send(blocks.close(ensure_one=True) + [
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": usage_body(gen.usage, written=written(gen))}),
        ("message_stop", {"type": "message_stop"})])
    await out.flush(last=True)
    return True
