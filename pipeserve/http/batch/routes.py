"""The routes of OpenAI's Files and Batch APIs: /v1/files (upload with purpose `batch`, list,
retrieve, content, delete) and /v1/batches (create from an uploaded JSONL file, list,
retrieve, cancel). Disk I/O runs on threads; the lines run in BatchRunner. Event loop."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import sanic
import sanic.exceptions
from sanic import HTTPResponse, Sanic

from pipeserve.errors import InvalidRequest, NotFound, PayloadTooLarge
from pipeserve.http.api.http import PRIORITY_HEADER, json_response, read_body
from pipeserve.http.batch import lines as L
from pipeserve.http.batch.files import FileStore
from pipeserve.http.batch.runner import BatchRunner
from pipeserve.http.batch.store import WINDOW_S, BatchStore, new_batch

MULTIPART_SLACK = 64 * 1024   # the multipart framing around the file, past its size cap
PURPOSES = ("batch",)


def add_routes(app: Sanic) -> None:
    server = app.ctx.cfg.server
    root = Path(server.files_dir).expanduser()
    files, store = FileStore(root), BatchStore(root)
    runner = BatchRunner(files, store, self_url(server.host, server.port),
                         _headers(app), server.batch_concurrency,
                         lambda inflight: _room(app, inflight))
    app.ctx.batches = runner

    @app.after_server_start
    async def _resume(app: Sanic) -> None:
        await runner.resume(lambda models: _serves(app, models))

    @app.before_server_stop
    async def _close(app: Sanic) -> None:
        await runner.close()

    @app.post("/v1/files", stream=True)
    async def upload(http: sanic.Request) -> HTTPResponse:
        data, name, purpose = await _read_upload(http, server.files_max_mb)
        return _object(await asyncio.to_thread(files.create, data, name, purpose))

    @app.get("/v1/files")
    async def list_files(http: sanic.Request) -> HTTPResponse:
        found = await asyncio.to_thread(files.list, http.args.get("purpose"))
        if http.args.get("order") == "asc":
            found.reverse()
        return json_response(_page(found, http))

    @app.get("/v1/files/<file_id:str>")
    async def get_file(http: sanic.Request, file_id: str) -> HTTPResponse:
        return _object(_found(await asyncio.to_thread(files.get, file_id), "file", file_id))

    @app.get("/v1/files/<file_id:str>/content")
    async def file_content(http: sanic.Request, file_id: str) -> HTTPResponse:
        data = _found(await asyncio.to_thread(files.content, file_id), "file", file_id)
        return HTTPResponse(data, content_type="application/jsonl")

    @app.delete("/v1/files/<file_id:str>")
    async def delete_file(http: sanic.Request, file_id: str) -> HTTPResponse:
        _found(await asyncio.to_thread(files.delete, file_id) or None, "file", file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch(http: sanic.Request) -> HTTPResponse:
        batch = await _create(read_body(http), files, lambda model: _answering(app, model))
        await asyncio.to_thread(store.save, batch)
        runner.start(batch["id"])
        return _object(batch)

    @app.get("/v1/batches")
    async def list_batches(http: sanic.Request) -> HTTPResponse:
        return json_response(_page(await asyncio.to_thread(store.list), http))

    @app.get("/v1/batches/<batch_id:str>")
    async def get_batch(http: sanic.Request, batch_id: str) -> HTTPResponse:
        return _object(_found(await asyncio.to_thread(store.get, batch_id), "batch", batch_id))

    @app.post("/v1/batches/<batch_id:str>/cancel")
    async def cancel_batch(http: sanic.Request, batch_id: str) -> HTTPResponse:
        """Cancelling: no line is sent from here on and those in flight stop; the batch ends
        cancelled, its output and error files holding the lines that finished."""
        batch = _found(await asyncio.to_thread(store.get, batch_id), "batch", batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            await asyncio.to_thread(store.save, batch)
            await runner.cancel(batch_id)
            batch = await asyncio.to_thread(store.get, batch_id)
        return _object(batch)


async def _read_upload(http: sanic.Request, cap_mb: float) -> tuple[bytes, str, str]:
    """The multipart body's `file` and `purpose`; a 413 naming server.files_max_mb past it."""
    cap = int(cap_mb * 1_000_000)
    too_large = PayloadTooLarge(f"the file is larger than server.files_max_mb ({cap_mb} MB)",
                                param="file", code="file_too_large")
    http.stream.request_max_size = cap + MULTIPART_SLACK
    try:
        await http.receive_body()
    except sanic.exceptions.PayloadTooLarge:
        raise too_large from None
    await asyncio.to_thread(lambda: (http.form, http.files))   # parsed (and kept) off the loop
    upload = http.files.get("file") if http.files else None
    if upload is None:
        raise InvalidRequest("the body must be multipart/form-data with a `file` part (the "
                             "JSONL file) and a `purpose` field", param="file")
    if len(upload.body) > cap:
        raise too_large
    purpose = http.form.get("purpose") if http.form else None
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose is {purpose!r:.40}; allowed: {', '.join(PURPOSES)}",
                             param="purpose")
    return upload.body, upload.name or "upload.jsonl", purpose


async def _create(body: dict[str, Any], files: FileStore,
                  answering: Callable[[Any], str | None]) -> dict[str, Any]:
    """A validated batch in status `validating`: a 400 for a bad field or an input file that
    holds no request, a 404 for an unknown file. It records the models its lines go to."""
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in L.ENDPOINTS:
        raise InvalidRequest(f"endpoint is {endpoint!r:.80}; allowed: {', '.join(L.ENDPOINTS)}",
                             param="endpoint")
    if window not in WINDOW_S:
        raise InvalidRequest(f"completion_window is {window!r:.40}; allowed: "
                             f"{', '.join(WINDOW_S)}", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidRequest("metadata must be an object of at most 16 string keys and "
                             "string values", param="metadata")
    fid = body.get("input_file_id")
    if not isinstance(fid, str):
        raise InvalidRequest("input_file_id is missing; upload the JSONL file with POST "
                             "/v1/files (purpose batch) and send its id", param="input_file_id")
    meta = _found(await asyncio.to_thread(files.get, fid), "file", fid)
    if meta["purpose"] != "batch":
        raise InvalidRequest(f"file {fid} has purpose {meta['purpose']!r}; a batch input needs "
                             "purpose 'batch'", param="input_file_id")
    data = _found(await asyncio.to_thread(files.content, fid), "file", fid)
    parsed = await asyncio.to_thread(L.parse, data, endpoint)
    models = {answering(line.body.get("model")) for line in parsed if line.body is not None}
    return new_batch(fid, endpoint, window, metadata, len(parsed),
                     sorted(m for m in models if m is not None))


def _shown(obj: dict[str, Any]) -> dict[str, Any]:
    """A file or batch object as OpenAI's schema has it: a field with no value yet (a
    timestamp still to come, no error file) is left out, not null; the store's own fields
    (named with a leading `_`) are not shown."""
    return {k: v for k, v in obj.items() if v is not None and not k.startswith("_")}


def _answering(app: Sanic, model: Any) -> str | None:
    """The model that answers a line naming `model` here: the one model of a server without a
    pool (it answers whatever a line names), else the pool member it routes to (None: none)."""
    pool = app.ctx.pool
    if pool is None:
        return str(app.ctx.cfg.model.name)
    try:
        return str(pool.member(model).id)
    except NotFound:
        return None


def _serves(app: Sanic, models: list[str]) -> bool:
    """Whether this server answers with each of the models a batch's lines went to where it
    was created: a server on the same server.files_dir serving another model leaves it open."""
    pool = app.ctx.pool
    served = {str(app.ctx.cfg.model.name)} if pool is None else set(pool.members)
    return set(models) <= served


def _object(obj: dict[str, Any]) -> HTTPResponse:
    return json_response(_shown(obj))


def _found(item: Any, kind: str, item_id: str) -> Any:
    if item is None:
        raise NotFound(f"{kind} {item_id!r:.80} is unknown or deleted", param=f"{kind}_id")
    return item


def _page(items: list[dict[str, Any]], http: sanic.Request) -> dict[str, Any]:
    """A cursor page as OpenAI lists: `after` an id, at most `limit` items, `has_more`."""
    after = http.args.get("after")
    if after is not None:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    try:
        limit = int(http.args.get("limit", 10000))
    except ValueError:
        raise InvalidRequest(f"limit is {http.args.get('limit')!r:.20}; an integer >= 1",
                             param="limit") from None
    page = [_shown(x) for x in items[:max(limit, 1)]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def _room(app: Sanic, inflight: int) -> bool:
    """A batch line may go now: the engine's rows, taken or asked for, and the batch lines in
    flight (some not at the engine yet) leave one row free for the next live request (on a
    one-row engine: it is idle). True while the model loads (the line gets a 503 and waits)."""
    engine = app.ctx.engine
    limits = engine.limits
    if limits is None:
        return True
    load = engine.load()
    most = max(1, limits.max_rows - 1)
    return load.num_waiting + load.num_running < most and inflight < most


def self_url(host: str, port: int) -> str:
    """This server's own address: loopback when it listens on every interface."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _headers(app: Sanic) -> dict[str, str]:
    """The batch lines' headers: the least urgent priority class, and the API key if set."""
    classes = app.ctx.cfg.admission.priority_classes
    headers = {PRIORITY_HEADER: max(classes, key=classes.__getitem__)}
    key = app.ctx.cfg.server.api_key   # never the admin key: it would grant urgent classes
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers
