"""Background responses across a restart. At launch (`restore`): finished ones on disk within
server.responses_ttl_s are readable again (GET, previous_response_id); open ones show
"in_progress" and are sent again to this server's own POST /v1/responses, with a header only
this process knows (`internal_key`), so the live handler runs them. That handler (`resuming`)
takes the stored id and lock, and `continuation` appends the checkpointed output ids to the
prompt, so generation goes on where it stopped (the prompt cache holds what it can of the
prefix). Event loop; disk I/O on threads."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import IO, Any

import httpx
import orjson
import sanic
from sanic import Sanic

from pipeserve.errors import InvalidRequest, NotFound
from pipeserve.http.api.background_store import OPEN, BackgroundStore
from pipeserve.http.batch.routes import self_url
from pipeserve.request import Request

log = logging.getLogger("pipeserve")
RESUME_HEADER = "x-pipeserve-resume"       # the response id a restart resumes
INTERNAL_HEADER = "x-pipeserve-internal"   # this process's own key: only it sends the above
RETRY_S = 1.0   # the wait before a refused (503, 429) or unconnected resubmission goes again


async def resuming(app: Sanic, http: sanic.Request) -> tuple[dict[str, Any], IO[bytes]] | None:
    """The stored record and its lock when this request resumes a background response."""
    rid = http.headers.get(RESUME_HEADER)
    if rid is None:
        return None
    if not hmac.compare_digest(http.headers.get(INTERNAL_HEADER, ""), app.ctx.internal_key):
        raise InvalidRequest(f"header {RESUME_HEADER} is the server's own (a restart resumes "
                             "background responses with it); a client cannot send it",
                             param=RESUME_HEADER)
    http.ctx.urgent_ok = True   # it was admitted at its priority once: a restart keeps it
    store: BackgroundStore = app.ctx.background_store
    record = await asyncio.to_thread(store.get, rid)
    if record is None or record.get("status") not in OPEN:
        raise NotFound(f"response {rid!r} is not an open background response",
                       param=RESUME_HEADER)
    claim = await asyncio.to_thread(store.claim, rid)
    if claim is None:
        raise InvalidRequest(f"response {rid!r} runs on another server sharing "
                             "server.files_dir", param=RESUME_HEADER, code="response_running")
    record = await asyncio.to_thread(store.get, rid)   # as it is now this server holds it
    if record is None or record.get("status") not in OPEN:
        claim.close()
        raise NotFound(f"response {rid!r} ended meanwhile", param=RESUME_HEADER)
    return record, claim


def continuation(req: Request, ids: list[int]) -> list[int]:
    """Append the checkpointed output `ids` to the prepared request's prompt and take them off
    its max_tokens; the ids appended. None are for a constrained output (its grammar state is
    the engine's, from the start) or a prompt with media: those start over. Ids from a stop
    token on are dropped (the run ended there), and one token is always left to generate."""
    if not ids or req.constraint is not None or req.media is not None:
        return []
    cut = next((i for i, t in enumerate(ids) if t in req.stop_token_ids), len(ids))
    keep = ids[:max(0, min(cut, req.sampling.max_tokens - 1))]
    req.prompt_ids = req.prompt_ids + keep
    req.sampling.max_tokens -= len(keep)
    return keep


async def restore(app: Sanic) -> None:
    """Launch: finished responses back in the response store, open ones resumed."""
    store: BackgroundStore = app.ctx.background_store
    ttl = app.ctx.cfg.server.responses_ttl_s
    records = await asyncio.to_thread(store.expire, ttl)
    now, todo = time.time(), []
    for r in records:
        body, conversation = r.get("response"), r.get("conversation") or []
        if not isinstance(body, dict):
            continue
        if r["status"] in OPEN:
            app.ctx.responses.put(r["id"], dict(body, status="in_progress"), conversation)
            todo.append(r)
        else:
            app.ctx.responses.put(r["id"], body, conversation,
                                  ttl_s=max(1.0, ttl - (now - (r.get("finished_at") or now))))
    if todo:
        app.ctx.resume_task = asyncio.create_task(_resubmit(app, todo))


async def _resubmit(app: Sanic, records: list[dict[str, Any]]) -> None:
    server = app.ctx.cfg.server
    headers = {INTERNAL_HEADER: app.ctx.internal_key, "content-type": "application/json"}
    if server.api_key:
        headers["authorization"] = f"Bearer {server.api_key}"
    async with httpx.AsyncClient(base_url=self_url(server.host, server.port), headers=headers,
                                 timeout=None) as client:
        for record in records:
            await _one(app, client, record)


async def _one(app: Sanic, client: httpx.AsyncClient, record: dict[str, Any]) -> None:
    rid = record["id"]
    body = dict(record["body"], stream=False)   # polled after a restart: the stream is gone
    log.info("response %s: resuming (%s, %d output tokens checkpointed)", rid,
             record["status"], len(record.get("output_ids") or []))
    while not getattr(app.ctx, "draining", False):
        try:
            r = await client.post("/v1/responses", content=orjson.dumps(body),
                                  headers={RESUME_HEADER: rid})
        except httpx.TransportError:   # the listener is not up yet
            await asyncio.sleep(RETRY_S)
            continue
        if r.status_code in (429, 503):   # loading, queue full
            await asyncio.sleep(RETRY_S)
            continue
        if r.status_code >= 400:
            log.warning("response %s: not resumed: %d %s", rid, r.status_code, r.text[:300])
            if r.status_code != 404 and "response_running" not in r.text:
                await _failed(app, record, r)
        return


async def _failed(app: Sanic, record: dict[str, Any], r: httpx.Response) -> None:
    """A response its own handler refuses now (the server's config changed): failed, with the
    handler's error, here and on disk."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": r.text[:500]}
    body = dict(record["response"], status="failed",
                error={"code": error.get("code") or "server_error",
                       "message": f"not resumed after a restart: {error.get('message')}"})
    app.ctx.responses.put(record["id"], body, [])
    record = dict(record, status="failed", response=body, finished_at=time.time())
    await asyncio.to_thread(app.ctx.background_store.save, record, 1)
