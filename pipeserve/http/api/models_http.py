"""The models API: GET /v1/models and /v1/models/{id} (OpenAI's shape plus context_length,
modalities, tool_format, loaded, state, resident_bytes), and under a pool POST
/v1/models/{id}/load (SSE progress when asked) and /unload, POST /v1/models/rescan
(pool.model_dir). Load, unload and rescan take server.admin_key when one is set. Event loop."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import fields as F
from pipeserve.http.api import openai as oa
from pipeserve.http.api.http import SSE_HEADERS, json_response, read_body, sse_data
from pipeserve.core.client import EngineState
from pipeserve.errors import InvalidRequest, NotFound, ServeError

PROGRESS_S = 0.5   # seconds between load progress events


class Conflict(ServeError):
    """The model cannot do that in its current state (409)."""

    status = 409
    error_type = "invalid_request_error"


def _facts(cfg: Any, limits: Any, front: Any) -> dict[str, Any]:
    """What the loaded model says of itself (None before its first load): its engine's
    published limits."""
    task = cfg.model.task.value   # generate | embed
    if limits is None:
        return {"context_length": None, "modalities": ["text"], "tool_format": None,
                "task": task}
    fmt = front.markup.tool_format if front is not None else None
    return {"context_length": limits.max_context, "modalities": list(limits.modalities),
            "tool_format": fmt.name if fmt is not None else None, "task": task}


def member_body(pool: Any, m: Any) -> dict[str, Any]:
    limits = m.engine.limits if m.engine is not None else None
    keep = m.keep_alive_s if m.keep_alive_s is not None else pool.cfg.idle_unload_s or -1
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "pipeserve",
            **_facts(m.cfg, limits, m.front), "loaded": m.ready, "state": m.state(),
            "resident_bytes": m.weight_bytes if m.ready else 0, "keep_alive_s": keep,
            "default": m.id == pool.default_id}


def single_bodies(app: Sanic) -> list[dict[str, Any]]:
    """One model in-process: it, then `base:adapter` for every mounted adapter."""
    ctx = app.ctx
    engine, name = ctx.engine, ctx.cfg.model.name
    limits = engine.limits
    ready = engine.state is EngineState.READY and (ctx.front is not None
                                                   or ctx.cfg.model.encoder)
    state = {EngineState.READY: "loaded", EngineState.LOADING: "loading",
             EngineState.DEAD: "failed", EngineState.STOPPED: "unloaded"}[engine.state]
    base = {"object": "model", "created": ctx.created, "owned_by": "pipeserve",
            **_facts(ctx.cfg, limits if ready else None, ctx.front), "loaded": ready,
            "state": state if ready or engine.state is not EngineState.READY else "loading",
            "resident_bytes": limits.model.weight_bytes if ready else 0, "keep_alive_s": -1,
            "default": True}
    ids = [name] + ([f"{name}:{a}" for a in limits.adapters.ids]
                    if limits is not None and limits.adapters is not None else [])
    return [{"id": i, **base, **({"default": False, "parent": name} if i != name else {})}
            for i in ids]


def bodies(app: Sanic) -> list[dict[str, Any]]:
    pool = app.ctx.pool
    if pool is None:
        return single_bodies(app)
    return [b for m in pool.members.values() for b in with_adapters(member_body(pool, m), m)]


def with_adapters(body: dict[str, Any], m: Any) -> list[dict[str, Any]]:
    """A member's entry, then `id:adapter` for each adapter its engine mounts (as last loaded),
    as one model in-process lists them."""
    limits = m.engine.limits if m.engine is not None else None
    ids = limits.adapters.ids if limits is not None and limits.adapters is not None else []
    return [body, *({**body, "id": f"{m.id}:{a}", "default": False, "parent": m.id}
                    for a in ids)]


def find_model(app: Sanic, model_id: str) -> dict[str, Any]:
    for body in bodies(app):
        if body["id"] == model_id:
            return body
    ids = ", ".join(b["id"] for b in bodies(app))
    raise NotFound(f"model {model_id[:200]!r} is not served here; the models are: {ids}",
                   param="model", code="model_not_found")


async def handle_list(app: Sanic, http: sanic.Request) -> HTTPResponse:
    return json_response({"object": "list", "data": bodies(app)})


async def handle_get(app: Sanic, http: sanic.Request, model_id: str) -> HTTPResponse:
    return json_response(find_model(app, model_id))


def _pool_member(app: Sanic, model_id: str, action: str) -> tuple[Any, Any]:
    pool = app.ctx.pool
    find_model(app, model_id)   # a 404 for an unknown id, whatever the server
    if pool is None:
        raise InvalidRequest(f"this server runs one model, loaded at launch; {action} needs a "
                             "pool (launch with pool=<name> or pool=dir pool.model_dir=<dir>)",
                             param="model")
    return pool, pool.members[model_id]


async def handle_load(app: Sanic, http: sanic.Request, model_id: str) -> HTTPResponse | None:
    """Load now (200 with the model's entry once loaded). `{"stream": true}` (or Accept:
    text/event-stream): SSE `model.load` events every PROGRESS_S while it loads, then the
    entry, then [DONE]. `keep_alive` sets how long it stays loaded when idle."""
    body = read_body(http) if http.body else {}
    pool, m = _pool_member(app, model_id, "loading a model")
    keep = F.keep_alive(body)
    if keep is not None:
        m.keep_alive_s = keep
    stream = (F.get(body, "stream", bool, False)
              or "text/event-stream" in http.headers.get("accept", ""))
    if not stream:
        await pool.loaded(m)
        return json_response(member_body(pool, m))
    task = asyncio.get_running_loop().create_task(pool.loaded(m))
    await asyncio.sleep(0)   # the task has started the load: the first event says so
    response = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
    t0 = time.monotonic()
    while not task.done():
        await response.send(sse_data({"object": "model.load", "id": m.id, "status": m.state(),
                                      "elapsed_s": round(time.monotonic() - t0, 2)}))
        await asyncio.wait([task], timeout=PROGRESS_S)
    error = task.exception()
    if isinstance(error, ServeError):
        await response.send(sse_data(oa.error_body(error.message, error.error_type,
                                                   error.param, error.code)))
    elif error is not None:
        raise error
    else:
        await response.send(sse_data({"object": "model.load", "id": m.id, "status": "loaded",
                                      "elapsed_s": round(time.monotonic() - t0, 2),
                                      "model": member_body(pool, m)}))
    await response.send(b"data: [DONE]\n\n")
    await response.eof()
    return None


async def handle_unload(app: Sanic, http: sanic.Request, model_id: str) -> HTTPResponse:
    """Unload now: 200 with its entry (state unloaded); 409 while it loads or serves."""
    pool, m = _pool_member(app, model_id, "unloading a model")
    if m.loading is not None:
        raise Conflict(f"model {m.id} is loading; unload it once it has loaded",
                       param="model", code="model_busy")
    if m.num_inflight or m.pins:
        raise Conflict(f"model {m.id} is serving {max(m.num_inflight, m.pins)} request(s); "
                       "unload it once they finish", param="model", code="model_busy")
    await pool.unload(m, "request")
    m.keep_alive_s = None
    return json_response(member_body(pool, m))


async def handle_rescan(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """pool.model_dir again: new models become members; members whose files went away are
    dropped once they are not loaded. 200 with what was added and removed, and every model."""
    pool = app.ctx.pool
    if pool is None or pool.cfg.model_dir is None:
        raise InvalidRequest("POST /v1/models/rescan needs pool.model_dir (launch with "
                             "pool=dir pool.model_dir=<dir>)", param="model_dir")
    added, removed = await pool.rescan()
    return json_response({"object": "list", "added": added, "removed": removed,
                          "data": bodies(app)})
