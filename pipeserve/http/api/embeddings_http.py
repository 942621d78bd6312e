"""POST /v1/embeddings in OpenAI's shape: `input` as a string, an array of strings, an array of
token ids or an array of token-id arrays; `encoding_format` float or base64 (little-endian
float32, as OpenAI's SDKs decode it); `dimensions` (the first N components, L2-normalised
again: Matryoshka truncation); `usage`. Served by an embedding model (model.task=embed,
pipeserve/embed/engine.py), alone or as a pool member. Event loop."""
from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import fields as F
from pipeserve.http.api import known_fields
from pipeserve.http.api.http import Scope, json_response, read_body, route
from pipeserve.embed.engine import Embed
from pipeserve.core.client import EngineState, reply_of
from pipeserve.errors import EngineUnavailable, InvalidRequest
from pipeserve.eventloop.offload import off_loop
from pipeserve.eventloop.token_bound import CharBound, char_bound

MAX_INPUTS = 2048   # OpenAI's bound on the array
WAIT_S = 600.0


def parse_input(body: dict[str, Any]) -> list[str | list[int]]:
    value = body.get("input")
    if isinstance(value, str) or F.token_ids(value):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise InvalidRequest("input must be a string, an array of strings, an array of token ids "
                             "or an array of token-id arrays (non-empty)", param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"input has {len(items)} items; the limit is {MAX_INPUTS}",
                             param="input")
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            continue
        if not F.token_ids(item):
            raise InvalidRequest(f"input[{i}] must be a non-empty string or a non-empty array "
                                 f"of token ids, got {F.short(item)}", param="input")
    return items



_BOUNDS: dict[int, CharBound | None] = {}   # by tokenizer: built once, on first use


def text_bound(loaded: Any) -> CharBound | None:
    """The least tokens a text can take with this model's tokenizer, from its length alone
    (pipeserve/eventloop/token_bound.py); None when the tokenizer's length bounds nothing."""
    tokenizer = loaded.tokenizer   # Hugging Face's; a pool's parent holds mlx-lm's wrapper of it
    key = id(tokenizer)
    if key not in _BOUNDS:
        backend = (getattr(tokenizer, "backend_tokenizer", None)
                   or getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None))
        _BOUNDS[key] = char_bound(backend) if backend is not None else None
    return _BOUNDS[key]


def check_lengths(loaded: Any, texts: list[tuple[str, str]], extra: int = 0) -> None:
    """Refuse, before any is tokenized, a text (`where`, text) that cannot fit the context
    (`extra`: tokens every row adds, a rerank query's)."""
    bound = text_bound(loaded)
    if bound is None:
        return
    for where, text in texts:
        least = bound.min_tokens(text) + extra
        if least > loaded.max_context:
            raise InvalidRequest(
                f"{where} is {len(text)} characters: at least {least} tokens (no token of this "
                f"tokenizer spells more than {bound.max_token_chars} characters); this model "
                f"reads at most {loaded.max_context} — shorten it", param=where.split("[")[0],
                code="context_length_exceeded")


def _tokenize(engine: Any, items: list[str | list[int]]) -> list[list[int]]:
    loaded = engine.limits.model
    vocab = int(loaded.config.get("vocab_size") or len(loaded.tokenizer))
    check_lengths(loaded, [(f"input[{i}]", t) for i, t in enumerate(items) if isinstance(t, str)])
    out = []
    for i, item in enumerate(items):
        ids = list(loaded.tokenizer.encode(item)) if isinstance(item, str) else list(item)
        if len(ids) > loaded.max_context:
            raise InvalidRequest(f"input[{i}] has {len(ids)} tokens; this model embeds at most "
                                 f"{loaded.max_context} — shorten it", param="input",
                                 code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"input[{i}] has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab})", param="input")
        out.append(ids)
    return out


async def embed(engine: Any, inputs: list[list[int]]) -> list[list[float]]:
    """Hand an Embed to the model's engine (in-process or a pool member's) and wait for it."""
    return await reply_of(engine.command(Embed(inputs)), WAIT_S, "embed the input")


def _shape(vectors: list[list[float]], dims: int | None, fmt: str) -> list[Any]:
    out: list[Any] = []
    for vec in vectors:
        if dims is not None:
            vec = vec[:dims]
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            vec = [v / norm for v in vec]
        out.append(base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
                   if fmt == "base64" else vec)
    return out


async def encoder(app: Sanic, scope: Scope, body: dict[str, Any], task: str, wrong: str,
                  code: str) -> Any:
    """The engine of the model the body names (a pool routes and pins it), which must be an
    encoder of `task` (else a 400 saying `wrong`) and ready (else a 503)."""
    ctx = scope.ctx = await route(app, body, pin=True)
    scope.pinned = ctx if ctx is not app.ctx else None
    if ctx.cfg.model.task.value != task:
        raise InvalidRequest(f"model {ctx.cfg.model.name!r} {wrong}", param="model", code=code)
    engine = ctx.engine
    if engine.state is not EngineState.READY or engine.limits is None:
        raise EngineUnavailable(f"the engine is {engine.state.value}; retry when /health is 200")
    return engine


async def handle(app: Sanic, http: sanic.Request) -> HTTPResponse:
    async with Scope(app, "embeddings", http) as scope:
        body = await off_loop(len(http.body or b""), read_body, http)
        known_fields.check(app.ctx, http, "embeddings", body)
        items = parse_input(body)
        fmt = F.get(body, "encoding_format", str, "float")
        if fmt not in ("float", "base64"):
            raise InvalidRequest(f"encoding_format is {fmt!r}; allowed: float, base64",
                                 param="encoding_format")
        dims = F.get(body, "dimensions", int)
        engine = await encoder(app, scope, body, "embed", "generates text; /v1/embeddings needs "
                               "an embedding model (model.task=embed, e.g. model=tiny_embed)",
                               "not_an_embedding_model")
        width = engine.limits.dimensions
        if dims is not None and not 1 <= dims <= width:
            raise InvalidRequest(f"dimensions is {dims}; this model's embeddings have {width} "
                                 f"(allowed range [1, {width}])", param="dimensions")
        ids = await off_loop(len(http.body or b""), _tokenize, engine, items)
        vectors = await embed(engine, ids)
        num = sum(len(x) for x in ids)
        data = [{"object": "embedding", "index": i, "embedding": e}
                for i, e in enumerate(_shape(vectors, dims, fmt))]
        return json_response({"object": "list", "data": data, "model": scope.ctx.cfg.model.name,
                              "usage": {"prompt_tokens": num, "total_tokens": num}})
