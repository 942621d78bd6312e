"""POST /v1/rerank (also /rerank and /v2/rerank), in the Cohere/Jina shape that vLLM and
llama-server speak: `query`, `documents` (strings or {"text": ...}), `top_n`,
`return_documents` → `results` [{index, relevance_score, document}] best first, and `usage`.
Served by a cross-encoder (model.task=rerank, pipeserve/embed/engine.py): each query-document pair
is one row of its batch, scored by the model's classifier head. Event loop."""
from __future__ import annotations

import uuid
from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import fields as F
from pipeserve.http.api import known_fields
from pipeserve.http.api.embeddings_http import MAX_INPUTS, check_lengths, embed, encoder, text_bound
from pipeserve.http.api.http import Scope, json_response, read_body
from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.offload import off_loop


def _documents(body: dict[str, Any]) -> list[str]:
    docs = F.get(body, "documents", list)
    if not docs:
        raise InvalidRequest("documents must be a non-empty array of strings (or of "
                             '{"text": ...} objects)', param="documents")
    if len(docs) > MAX_INPUTS:
        raise InvalidRequest(f"documents has {len(docs)} items; the limit is {MAX_INPUTS}",
                             param="documents")
    out = []
    for i, doc in enumerate(docs):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise InvalidRequest(f"documents[{i}] must be a string or an object with a string "
                                 f"`text`, got {F.short(doc)}", param="documents")
        out.append(text)
    return out


def _pairs(engine: Any, query: str, docs: list[str]) -> list[list[int]]:
    """Each (query, document) as the model's tokenizer encodes a pair (its special tokens)."""
    loaded = engine.limits.model
    tokenizer = loaded.tokenizer   # Hugging Face's; a pool's parent holds mlx-lm's wrapper of it
    if type(tokenizer).__name__ == "TokenizerWrapper":
        tokenizer = tokenizer._tokenizer
    check_lengths(loaded, [("query", query)])
    bound = text_bound(loaded)
    query_least = bound.min_tokens(query) if bound is not None else 0
    check_lengths(loaded, [(f"documents[{i}]", d) for i, d in enumerate(docs)], query_least)
    out = []
    for i, doc in enumerate(docs):
        ids = list(tokenizer(query, doc)["input_ids"])
        if len(ids) > loaded.max_context:
            raise InvalidRequest(f"query + documents[{i}] is {len(ids)} tokens; this model reads "
                                 f"at most {loaded.max_context} — shorten them", param="documents",
                                 code="context_length_exceeded")
        out.append(ids)
    return out


async def handle(app: Sanic, http: sanic.Request) -> HTTPResponse:
    async with Scope(app, "rerank", http) as scope:
        body = await off_loop(len(http.body or b""), read_body, http)
        known_fields.check(app.ctx, http, "rerank", body)
        query = F.get(body, "query", str)
        if not query:
            raise InvalidRequest("query must be a non-empty string", param="query")
        docs = _documents(body)
        top_n = F.get(body, "top_n", int, len(docs))
        if top_n < 1:
            raise InvalidRequest(f"top_n is {top_n}; it must be at least 1", param="top_n")
        with_docs = F.get(body, "return_documents", bool, True)
        engine = await encoder(app, scope, body, "rerank", "is not a reranker; /v1/rerank needs "
                               "a cross-encoder (model.task=rerank, e.g. model=tiny_rerank)",
                               "not_a_reranker")
        ids = await off_loop(len(http.body or b""), _pairs, engine, query, docs)
        scores = [row[0] for row in await embed(engine, ids)]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if with_docs else {})} for i in order]
        num = sum(len(x) for x in ids)
        return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": scope.ctx.cfg.model.name,
                              "results": results,
                              "usage": {"prompt_tokens": num, "total_tokens": num}})
