"""Responses `background: true`: the request is admitted and submitted as any other, at the least
urgent priority class unless it names one, and answered at once with the response object in
status "queued", stored so that `GET /v1/responses/{id}` polls it ("in_progress" from its first
token, then "completed", "incomplete" or "failed"). The generation runs on as a task that stores
the finished response; `POST /v1/responses/{id}/cancel` stops it and stores it as "cancelled".
Each one is also kept on disk (Persisted: the request, its output token ids every
server.background_checkpoint_tokens, the end), and a server that stops suspends them there
instead of cancelling, so the next launch resumes them (background_resume.py). Event loop."""
from __future__ import annotations

import asyncio
import time
from typing import IO, Any, Awaitable, Callable

from sanic import Sanic
from sanic.response import HTTPResponse

from pipeserve.errors import InvalidRequest, NotFound, ServeError
from pipeserve.http.api.background_store import OPEN, BackgroundStore
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.http import json_response
from pipeserve.http.api.responses_shape import ResponseShape

# stores a response body under its id; the conversation it stored with it
Save = Callable[[dict[str, Any]], list[dict[str, Any]]]
Running = dict[str, "asyncio.Task[None]"]   # app.ctx.background: response id → its task


class Persisted:
    """One background response's record on disk, rewritten (off the loop) as it goes: the
    request body, its status, the output token ids so far, and once it ended the response and
    its conversation. Holds the response's lock while this server runs it."""

    def __init__(self, store: BackgroundStore, record: dict[str, Any], every: int,
                 claim: IO[bytes] | None) -> None:
        self.store, self.record, self.every, self.claim = store, record, every, claim
        self.rev = 0
        self.saved = len(record.get("output_ids") or [])

    @classmethod
    async def new(cls, app: Sanic, response_id: str, body: dict[str, Any], created_at: int,
                  resumed: tuple[dict[str, Any], IO[bytes]] | None = None) -> Persisted:
        """A new response's record; `resumed`: the record and lock of one a restart resumes."""
        store: BackgroundStore = app.ctx.background_store
        every = app.ctx.cfg.server.background_checkpoint_tokens
        if resumed is not None:
            return cls(store, resumed[0], every, resumed[1])
        record = {"id": response_id, "body": body, "status": "queued", "created_at": created_at,
                  "output_ids": [], "response": None, "conversation": None,
                  "finished_at": None}
        return cls(store, record, every, await asyncio.to_thread(store.claim, response_id))

    async def write(self, **changes: Any) -> None:
        self.record.update(changes)
        self.rev += 1
        await asyncio.to_thread(self.store.save, dict(self.record), self.rev)

    async def tick(self, gen: Generation) -> None:
        """A checkpoint once the output grew by `every` tokens since the last."""
        ids = gen.ids or []
        if len(ids) - self.saved >= self.every:
            self.saved = len(ids)
            await self.write(status="in_progress", output_ids=list(ids))

    async def suspend(self, gen: Generation) -> None:
        """The server stops: the output so far, still open, for the next launch."""
        await self.write(status="in_progress", output_ids=list(gen.ids or []))

    async def end(self, body: dict[str, Any], conversation: list[dict[str, Any]],
                  gen: Generation | None) -> None:
        ids = list(gen.ids or []) if gen is not None else self.record["output_ids"]
        await self.write(status=body["status"], response=body, conversation=conversation,
                         output_ids=ids, finished_at=time.time())

    def close(self) -> None:
        """Let go of the lock; an ended response's lock file goes (a resume of it re-reads
        its status once it holds the lock)."""
        if self.claim is not None:
            if self.record["status"] not in OPEN:
                self.store.unlock(self.record["id"])
            self.claim.close()
            self.claim = None


def stopping(app: Sanic) -> bool:
    """A task cancelled now is the server stopping (suspend it), not a client's cancel."""
    return bool(getattr(app.ctx, "draining", False))


async def suspend(app: Sanic) -> None:
    """Server stop: every running background response is checkpointed and stopped (the drain
    does not wait for them; the next launch resumes them)."""
    tasks = list(app.ctx.background.values())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def least_urgent(classes: dict[str, int]) -> str:
    """The priority class a background request runs at when it names none."""
    return max(classes, key=classes.__getitem__)


async def launch(app: Sanic, scope: Any, gen: Generation, shape: ResponseShape,
                 save: Save, persisted: Persisted, resumed: bool = False) -> HTTPResponse:
    """Answer now with the queued response (in_progress when `resumed` after a restart); the
    generation goes on in a task the scope waits for (its log line and metrics settle when it
    ends)."""
    running: Running = app.ctx.background
    rid = gen.request.request_id
    queued = shape.body([], None, status="in_progress" if resumed else "queued")
    save(queued)
    await persisted.write(status=queued["status"], response=queued)
    if gen.ids is None:
        gen.ids = []

    async def finish() -> None:
        # registered by its own first step: a task cancelled before that step runs none of
        # its code (nothing below would store "cancelled"), so none can be cancelled unseen
        running[rid] = asyncio.current_task()   # type: ignore[assignment]
        started = resumed
        try:
            async for _ in gen.deltas():
                if not started:   # its first token: polling says in_progress from here
                    started = True
                    save(shape.body([], None, status="in_progress"))
                await persisted.tick(gen)
            final = shape.body(shape.output(gen), gen)
            await persisted.end(final, save(final), gen)
        except asyncio.CancelledError:
            await _stopped(app, gen, shape, save, persisted)
            raise
        except ServeError as e:
            failed = shape.body([], gen, status="failed",
                                error={"code": e.code or "server_error", "message": str(e)})
            await persisted.end(failed, save(failed), gen)
            raise
        finally:
            running.pop(rid, None)
            persisted.close()

    task = asyncio.create_task(finish())
    scope.detach(task)
    return json_response(queued)


async def _stopped(app: Sanic, gen: Generation, shape: ResponseShape, save: Save,
                   persisted: Persisted) -> None:
    """Cancelled: by the server stopping (suspended on disk, resumed by the next launch) or by
    POST .../cancel (stored as cancelled)."""
    if stopping(app):
        await persisted.suspend(gen)
        return
    body = shape.body(shape.output(gen, cut=True), gen, status="cancelled")   # what it wrote
    await persisted.end(body, save(body), gen)


async def streamed(app: Sanic, gen: Generation, shape: ResponseShape, save: Save,
                   persisted: Persisted,
                   stream: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`background` with `stream`: the event chain is the stream's (resumable with
    `GET /v1/responses/{id}?stream=true&starting_after=N`), and the response is stored as it
    goes, so polling and cancel work as for an unstreamed one. The final body. `stream` calls
    `persisted.tick` after each delta."""
    running: Running = app.ctx.background
    rid = gen.request.request_id
    task = asyncio.current_task()
    assert task is not None
    running[rid] = task
    body = shape.body([], None, status="in_progress")
    save(body)
    if gen.ids is None:
        gen.ids = []
    try:
        await persisted.write(status="in_progress", response=body)
        final = await stream()
        await persisted.end(final, save(final), gen)
    except asyncio.CancelledError:
        await _stopped(app, gen, shape, save, persisted)
        raise
    finally:
        running.pop(rid, None)
        persisted.close()
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
    if task is None and item.body.get("status") in OPEN:
        await _cancel_waiting(app, response_id, item.body, item.conversation)
        item = app.ctx.responses.get(response_id) or item
    return json_response(item.body)


RESUMED_WAIT_POLLS = 1000   # 10 ms apart: a resume still loading its engine is not waited out


async def _resumed_here(app: Sanic, response_id: str) -> asyncio.Task[Any] | None:
    """The task of a response this server's resume claimed but had not registered yet (its
    request between the claim and the task), waited for while that resume is still running."""
    resume = getattr(app.ctx, "resume_task", None)
    for _ in range(RESUMED_WAIT_POLLS):
        if (task := app.ctx.background.get(response_id)) is not None:
            return task
        if resume is None or resume.done():
            break
        await asyncio.sleep(0.01)
    return app.ctx.background.get(response_id)


async def _cancel_waiting(app: Sanic, response_id: str, body: dict[str, Any],
                          conversation: list[dict[str, Any]]) -> None:
    """A response a restart left open and has not resumed yet: cancelled here and on disk,
    unless another server sharing the directory runs it."""
    store: BackgroundStore = app.ctx.background_store
    claim = await asyncio.to_thread(store.claim, response_id)
    record = await asyncio.to_thread(store.get, response_id)
    if claim is None or record is None:
        if claim is not None:
            claim.close()
        elif (task := await _resumed_here(app, response_id)) is not None:
            task.cancel()   # this server's resume had claimed it a moment before
            try:
                await task
            except (asyncio.CancelledError, ServeError):
                pass
        return
    persisted = Persisted(store, record, 1, claim)
    cancelled = dict(body, status="cancelled")
    app.ctx.responses.put(response_id, cancelled, conversation)
    try:
        await persisted.end(cancelled, conversation, None)
    finally:
        persisted.close()
