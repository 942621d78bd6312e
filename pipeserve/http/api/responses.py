"""OpenAI Responses routes: create (a Response body, its streaming event chain, or a
background response), input_tokens, retrieve and delete. The bodies are parsed in
responses_request.py, shaped in responses_shape.py, and stored with their conversation in
responses_conversation.py. Event loop."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import IO, Any, Awaitable, Callable

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import known_fields
from pipeserve.http.api import fields as F
from pipeserve.http.api import resume
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.http import (Scope, check_ready, json_response, read_body, ready_front,
                                     route, sse_event)
from pipeserve.http.api.responses_conversation import Looked, drop_oldest, save_response
from pipeserve.http.api.responses_request import NO_SUMMARY, Parsed, parse
from pipeserve.http.api.responses_shape import ResponseEvents, ResponseShape
from pipeserve.http.api.resume import StreamLog
from pipeserve.http.api import responses_background as background
from pipeserve.http.api import background_resume
from pipeserve.errors import InvalidRequest, NotFound, ServeError
from pipeserve.eventloop.offload import off_loop
from pipeserve.request import Request

Resumed = tuple[dict[str, Any], IO[bytes]]   # the record and lock of a response a restart resumes


async def handle_create(app: Sanic, http: sanic.Request) -> HTTPResponse | None:
    async with Scope(app, "responses", http) as scope:
        check_ready(app)
        body, parsed = await _read(app, http)
        await scope.route(body)
        ctx = scope.ctx
        adapter = F.adapter(body, ctx.cfg.model.name, ctx.engine.limits.adapters)
        if parsed.background:
            _background_checks(parsed, ctx.cfg.admission.priority_classes)
        resumed = await background_resume.resuming(app, http) if parsed.background else None
        rid = resumed[0]["id"] if resumed is not None else f"resp_{uuid.uuid4().hex}"
        keep = resume.resumable(body)
        try:
            gen = await _start(scope, lambda: _request(rid, parsed, adapter), parsed,
                               resumed[0].get("output_ids") if resumed is not None else None)
        except BaseException:
            if resumed is not None:
                resumed[1].close()
            raise
        shape = ResponseShape(gen.request.request_id, ctx.cfg.model.name, parsed.echo,
                              gen.request.sampling, parsed.store, parsed.tools.custom)
        persisted = None
        if parsed.background:   # on disk until it ends: a restart resumes it
            persisted = await _persist(app, rid, body, shape, resumed)

        def save(b: dict[str, Any]) -> list[dict[str, Any]]:
            return save_response(app.ctx.responses, b, parsed.conversation, gen)
        if parsed.stream:
            await _serve_stream(app, http, scope, gen, shape, parsed, persisted, save, keep)
            return None
        if persisted is not None:
            return await background.launch(app, scope, gen, shape, save, persisted,
                                           resumed=resumed is not None)
        await gen.run()
        body = shape.body(shape.output(gen), gen)
        if parsed.store:
            save_response(app.ctx.responses, body, parsed.conversation, gen)
        return json_response(body)


async def handle_input_tokens(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """POST /v1/responses/input_tokens: the prompt's token count of a Responses body, equal to
    the input_tokens a request with the same body reports."""
    check_ready(app)
    body, parsed = await _read(app, http)
    front = ready_front(app, await route(app, body))
    req = await front.tokenize(front.normalise(Request(
        request_id=f"count-{uuid.uuid4().hex}", endpoint="count_tokens", inputs=parsed.inputs,
        constraint=parsed.constraint)))
    return json_response({"object": "response.input_tokens",
                          "input_tokens": req.num_prompt_tokens})


async def _read(app: Sanic, http: sanic.Request) -> tuple[dict[str, Any], Parsed]:
    """The body and what parse makes of it: the JSON and its validation off the loop when
    large; the response store (event loop only) is read here, and parse gets the one entry it
    may ask for."""
    size = len(http.body or b"")
    body = await off_loop(size, read_body, http)
    known_fields.check(app.ctx, http, "responses", body)
    parsed = await off_loop(size, parse, body, Looked(body, app.ctx.responses),
                            app.ctx.cfg.server.strict_fields)
    return body, parsed


def _request(rid: str, parsed: Parsed, adapter: str | None) -> Request:
    """A fresh Request of the parsed body (truncation auto builds one per try)."""
    req = Request(request_id=rid, endpoint="responses", inputs=parsed.inputs,
                  requested=parsed.requested, constraint=parsed.constraint,
                  adapter=adapter)
    dropped = parsed.tools.warning()
    if dropped is not None:
        req.warnings.append(dropped)
    if parsed.echo["reasoning"]["summary"] is not None:
        req.warnings.append(NO_SUMMARY)
    return req


async def _persist(app: Sanic, rid: str, body: dict[str, Any], shape: ResponseShape,
                   resumed: Resumed | None) -> background.Persisted:
    """A background response's record on disk; one a restart resumes keeps its created_at."""
    if resumed is not None:
        shape.created_at = resumed[0]["created_at"]
    return await background.Persisted.new(app, rid, body, shape.created_at, resumed)


async def _serve_stream(app: Sanic, http: sanic.Request, scope: Scope, gen: Generation,
                        shape: ResponseShape, parsed: Parsed,
                        persisted: background.Persisted | None,
                        save: background.Save, keep: bool) -> None:
    """`stream`: the event chain, resumable when `keep`; stored at its end."""
    async def produce(log: StreamLog) -> None:
        if persisted is not None:   # stored as it goes; POST .../cancel stops the task
            final = await background.streamed(
                app, gen, shape, save, persisted,
                lambda: _stream(log, gen, shape, persisted.tick))
        else:
            final = await _stream(log, gen, shape)
        scope.failed = final["status"] == "failed"
        if not scope.failed and parsed.store:   # stored even when the client left
            save(final)
    await resume.serve(http, app.ctx.streams, gen.request.request_id, keep,
                       scope.ctx.cfg.server.keep_alive_s, produce, scope.detach,
                       background=parsed.background)


def _background_checks(parsed: Parsed, classes: dict[str, int]) -> None:
    """A background response is read back from the store, and runs behind interactive work."""
    if not parsed.store:
        raise InvalidRequest("background is true with store false; a background response is "
                             "polled from the store: send store true", param="store")
    if parsed.requested.priority is None:
        parsed.requested = replace(parsed.requested,
                                   priority=background.least_urgent(classes))


MAX_TRUNCATIONS = 256   # oldest turns truncation "auto" drops at most


async def _start(scope: Scope, make: Callable[[], Request], parsed: Parsed,
                 resumed: list[int] | None = None) -> Generation:
    """Start a request built by `make()`; `resumed`: output ids a restart checkpointed, which
    its prompt continues. truncation "auto": while its prompt is past the context, drop the
    conversation's oldest turn and try again, and say so."""
    dropped = 0
    for _ in range(MAX_TRUNCATIONS):
        try:
            req = await scope.prepare(make())
        except InvalidRequest as e:
            if (e.code != "context_length_exceeded" or parsed.echo["truncation"] != "auto"
                    or not drop_oldest(parsed.inputs)):
                raise
            dropped += 1
            continue
        ids = background_resume.continuation(req, resumed or [])
        gen = scope.submit(req)
        if ids:
            gen.resume(ids)
        if dropped:
            gen.request.warnings.append(f"truncation auto: the {dropped} oldest turn(s) of the "
                                        "input were dropped to fit the context")
        return gen
    raise InvalidRequest(f"truncation auto dropped {MAX_TRUNCATIONS} turns and the input is "
                         "still past the context; shorten it", param="input",
                         code="context_length_exceeded")


async def _stream(log: StreamLog, gen: Generation, shape: ResponseShape,
                  tick: Callable[[Generation], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Append the event chain to `log`; the final response body (status "failed" after an
    error). `tick`: awaited after each delta (a background response's checkpoints)."""
    events = ResponseEvents(shape)

    async def send(batch: list[dict[str, Any]]) -> None:
        for event in batch:
            await log.put(sse_event(event["type"], event))

    await send(events.begin())
    try:
        async for delta in gen.deltas():
            if delta:
                await send(events.feed(delta))
            if tick is not None:
                await tick(gen)
    except ServeError as e:
        failed = events.fail(e)
        await send(failed)
        return failed[-1]["response"]
    final = events.end(gen)
    await send(final)
    return final[-1]["response"]


async def handle_get(app: Sanic, http: sanic.Request, response_id: str) -> HTTPResponse | None:
    if http.args.get("stream") == "true":   # OpenAI's resume: ?stream=true&starting_after=N
        await resume.resume(http, app.ctx.streams, response_id, app.ctx.cfg.server.keep_alive_s)
        return None
    item = app.ctx.responses.get(response_id)
    if item is None:
        raise NotFound(f"response {response_id!r} is unknown or expired", param="response_id")
    return json_response(item.body)


async def handle_delete(app: Sanic, http: sanic.Request, response_id: str) -> HTTPResponse:
    on_disk = await asyncio.to_thread(app.ctx.background_store.delete, response_id)
    if not app.ctx.responses.delete(response_id) and not on_disk:
        raise NotFound(f"response {response_id!r} is unknown or expired", param="response_id")
    return json_response({"id": response_id, "object": "response", "deleted": True})
