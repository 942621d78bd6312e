"""The routes of the scripting API (docs/api.md): the models API, the tokenizer endpoints,
embeddings and rerank. Each handler lives in its own module; this only wires paths to them.
Event loop."""
from __future__ import annotations

from typing import Callable

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import (embeddings_http, fit_http, models_http, rerank_http,
                                tokenizer_http)
from pipeserve.errors import NotFound


def add_routes(app: Sanic, admin: Callable[[sanic.Request], None]) -> None:
    """`admin(http)`: raises 401 unless the request carries server.admin_key (when set)."""
    @app.get("/v1/models")
    async def models(http: sanic.Request) -> HTTPResponse:
        """The base model, then `base:adapter` for every mounted adapter (vLLM-style: an
        OpenAI client selects one with `model`); a pool's ids. pipeserve/http/api/models_http.py."""
        return await models_http.handle_list(app, http)

    @app.get("/v1/models/<target:path>")   # the same parameter name as the POST route's
    async def model(http: sanic.Request, target: str) -> HTTPResponse:
        """GET /v1/models/{id} and /v1/models/{id}/fit (an id may hold '/')."""
        model_id, _, action = target.rpartition("/")
        if action == "fit" and model_id:
            return await fit_http.handle_fit(app, http, model_id)
        return await models_http.handle_get(app, http, target)

    @app.post("/v1/models/<target:path>")
    async def model_action(http: sanic.Request, target: str) -> HTTPResponse | None:
        """POST /v1/models/{id}/load, /v1/models/{id}/unload, /v1/models/rescan (an id may
        hold '/', a Hugging Face id's, so the action is the path's last part)."""
        admin(http)
        model_id, _, action = target.rpartition("/")
        if target == "rescan":
            return await models_http.handle_rescan(app, http)
        if action == "load" and model_id:
            return await models_http.handle_load(app, http, model_id)
        if action == "unload" and model_id:
            return await models_http.handle_unload(app, http, model_id)
        raise NotFound(f"POST /v1/models/{target[:200]}: the actions are /v1/models/{{id}}/load, "
                       "/v1/models/{id}/unload and /v1/models/rescan")

    @app.post("/tokenize")
    async def tokenize(http: sanic.Request) -> HTTPResponse:
        return await tokenizer_http.handle_tokenize(app, http)

    @app.post("/detokenize")
    async def detokenize(http: sanic.Request) -> HTTPResponse:
        return await tokenizer_http.handle_detokenize(app, http)

    @app.get("/tokenizer_info")
    async def tokenizer_info(http: sanic.Request) -> HTTPResponse:
        return await tokenizer_http.handle_tokenizer_info(app, http)

    @app.post("/v1/chat/template")
    async def chat_template(http: sanic.Request) -> HTTPResponse:
        return await tokenizer_http.handle_chat_template(app, http)

    @app.post("/v1/embeddings")
    async def embeddings(http: sanic.Request) -> HTTPResponse:
        return await embeddings_http.handle(app, http)

    async def rerank(http: sanic.Request) -> HTTPResponse:
        return await rerank_http.handle(app, http)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):   # vLLM serves all three
        app.add_route(rerank, path, methods=["POST"], name=f"rerank{path.replace('/', '_')}")
