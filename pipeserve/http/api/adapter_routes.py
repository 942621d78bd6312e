"""The adapters API: GET /v1/adapters lists the mounted LoRA adapters, POST mounts one and
DELETE unmounts one at runtime (hot-swap, pipeserve/adapters/swap.py). Event loop."""
from __future__ import annotations

from typing import Any, Callable

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.adapters import swap as adapter_swap
from pipeserve.core.events import AdapterSwap
from pipeserve.errors import EngineUnavailable, InvalidRequest
from pipeserve.http.api.http import json_response, read_body


def add_routes(app: Sanic, admin: Callable[[sanic.Request], None]) -> None:
    """`admin(http)`: raises 401 unless the request carries server.admin_key (when set)."""
    @app.get("/v1/adapters")
    async def adapters(http: sanic.Request) -> HTTPResponse:
        """The mounted adapters (at launch: model.adapter and model.adapters; at runtime:
        POST /v1/adapters); the launch default (what requests naming none run with) has
        `default: true`. A pool lists every member's (each entry names its `model`), as
        last loaded; one model in its own process (server.isolate=true) lists as in-process."""
        pool = app.ctx.pool
        if pool is not None and not pool.single:
            return json_response({"object": "list", "data": [
                {**entry, "model": m.id} for m in pool.members.values()
                for entry in _mounted(m.engine.limits if m.engine is not None else None)]})
        engine = app.ctx.engine if pool is None else pool.members[pool.default_id].engine
        limits = engine.limits if engine is not None else None
        if limits is None:
            raise EngineUnavailable("the model is still loading; retry after Retry-After seconds")
        return json_response({"object": "list", "data": _mounted(limits)})

    async def _swap(model: Any, adapter_id: str, mount: bool) -> dict[str, object]:
        """Hot-swap (pipeserve/adapters/swap.py): the engine thread mounts or unmounts between
        steps; this handler only awaits its reply. Under a pool (or server.isolate=true) the
        command crosses to the engine process of the member `model` names (the default one
        when it names none), loaded first."""
        pool = app.ctx.pool
        engine = app.ctx.engine if pool is None else (await pool.context(model)).engine
        return await adapter_swap.request(engine, AdapterSwap(adapter_id, mount))

    @app.post("/v1/adapters")
    async def mount_adapter(http: sanic.Request) -> HTTPResponse:
        """Mount model.adapter_dir/<id> at runtime: 200 with its /v1/adapters entry; 400 (not
        an id, a path out of the directory, files that do not fit the base model, DoRA), 404
        (no such subdirectory), 409 (already mounted). Needs server.admin_key when set.
        Under a pool, `model` names the member."""
        admin(http)
        body = read_body(http)
        if not isinstance(body.get("id"), str):
            raise InvalidRequest('the body must be a JSON object {"id": "<subdirectory of '
                                 'model.adapter_dir>"}', param="id")
        return json_response(await _swap(body.get("model"), body["id"], True))

    @app.delete("/v1/adapters/<adapter_id:str>")
    async def unmount_adapter(http: sanic.Request, adapter_id: str) -> HTTPResponse:
        """Unmount: 200 with the entry it had, `deleted: true`; 404 when not mounted; 409 for
        the launch default or while running or waiting requests use it (the count named).
        Under a pool, `?model=` names the member."""
        admin(http)
        return json_response({**await _swap(http.args.get("model"), adapter_id, False),
                              "deleted": True})


def _mounted(limits: Any) -> list[dict[str, object]]:
    """A model's mounted adapters as /v1/adapters lists them (none while it is not loaded)."""
    set_ = limits.adapters if limits is not None else None
    return ([{**a.describe(), "default": a.id == set_.default}
             for a in set_.adapters.values()] if set_ is not None else [])
