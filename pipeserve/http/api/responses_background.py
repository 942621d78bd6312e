"""Responses `background: true`: the request is admitted and submitted as any other, at the least
urgent priority class unless it names one, and answered at once with the response object in
status "queued", stored so that `GET /v1/responses/{id}` polls it ("in_progress" from its first
token, then "completed", "incomplete" or "failed"). The generation runs on as a task that stores
the finished response; `POST /v1/responses/{id}/cancel` stops it and stores it as "cancelled".
Event loop."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from sanic import Sanic
from sanic.response import HTTPResponse

from pipeserve.errors import InvalidRequest, NotFound, ServeError
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.http import json_response
from pipeserve.http.api.responses_shape import ResponseShape

Save = Callable[[dict[str, Any]], None]   # stores a response body under its id
Running = dict[str, "asyncio.Task[None]"]   # app.ctx.background: response id → its task


def least_urgent(classes: dict[str, int]) -> str:
    """The priority class a background request runs at when it names none."""
    return max(classes, key=classes.__getitem__)


def launch(app: Sanic, scope: Any, gen: Generation, shape: ResponseShape,
           save: Save) -> HTTPResponse:
    """Answer now with the queued response; the generation goes on in a task the scope waits
    for (its log line and metrics settle when it ends)."""
    running: Running = app.ctx.background
    rid = gen.request.request_id
    queued = shape.body([], None, status="queued")
    save(queued)

    async def finish() -> None:
        started = False
        try:
            async for _ in gen.deltas():
                if not started:   # its first token: polling says in_progress from here
                    started = True
                    save(shape.body([], None, status="in_progress"))
            save(shape.body(shape.output(gen), gen))
        except asyncio.CancelledError:
            save(shape.body([], gen, status="cancelled"))
            raise
        except ServeError as e:
            save(shape.body([], gen, status="failed",
                            error={"code": e.code or "server_error", "message": str(e)}))
            raise
        finally:
            running.pop(rid, None)

    task = asyncio.create_task(finish())
    running[rid] = task
    scope.detach(task)
    return json_response(queued)


async def streamed(app: Sanic, gen: Generation, shape: ResponseShape, save: Save,
                   stream: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`background` with `stream`: the event chain is the stream's (resumable with
    `GET /v1/responses/{id}?stream=true&starting_after=N`), and the response is stored as it
    goes, so polling and cancel work as for an unstreamed one. The final body."""
    running: Running = app.ctx.background
    rid = gen.request.request_id
    task = asyncio.current_task()
    assert task is not None
    running[rid] = task
    save(shape.body([], None, status="in_progress"))
    try:
        final = await stream()
    except asyncio.CancelledError:
        save(shape.body([], gen, status="cancelled"))
        raise
    finally:
        running.pop(rid, None)
    if final["status"] == "failed":
        save(final)
    return final


async def cancel(app: Sanic, response_id: str) -> HTTPResponse:
    """Stop a running background response (stored as "cancelled"); one already finished is
    returned as it is."""
    task = app.ctx.background.get(response_id)
    if task is not None:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, ServeError):
            pass
    item = app.ctx.responses.get(response_id)
    if item is None:
        raise NotFound(f"response {response_id!r} is unknown or expired", param="response_id")
    if item.body.get("background") is not True:
        raise InvalidRequest(f"response {response_id!r} was not created with background true; "
                             "only a background response can be cancelled",
                             param="response_id")
    return json_response(item.body)
