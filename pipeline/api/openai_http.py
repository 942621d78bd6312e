"""OpenAI chat and completions handlers: body → Request → Generation → JSON body or SSE
chunks (reasoning_content, content, tool_calls deltas; usage last). Event loop."""
from __future__ import annotations

import uuid
from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeline.api import openai as oa
from pipeline.api.generation import Generation
from pipeline.api.http import SSE_HEADERS, Scope, json_response, read_body, ready_front, sse_data
from pipeline.errors import ServeError
from pipeline.request import Request


async def handle(app: Sanic, http: sanic.Request, endpoint: str) -> HTTPResponse | None:
    """POST /v1/chat/completions (endpoint "chat") and /v1/completions ("completions")."""
    ctx = app.ctx
    async with Scope(app, endpoint, http) as scope:
        front = ready_front(app)
        body = read_body(http)
        chat = endpoint == "chat"
        parsed = oa.parse_chat(body) if chat else oa.parse_completion(body)
        req = Request(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                      endpoint=endpoint, inputs=parsed.inputs, requested=parsed.requested,
                      constraint=parsed.constraint)
        gen = await scope.start(req, parse_output=chat)
        req = gen.request
        fp = f"fp_{ctx.config_hash}"
        shape: Any = (oa.ChatShape if chat else oa.CompletionShape)(
            req.request_id, ctx.cfg.model.name, front.token_info, fp)
        if parsed.stream:
            scope.failed = not await _stream(http, gen, shape, parsed, chat)
            return None
        await gen.run()
        lps = gen.all_logprobs if req.sampling.logprobs else None
        if chat:
            return json_response(shape.body(gen.content, gen.finish_reason, lps, gen.usage,
                                            gen.reasoning, gen.tool_calls))
        prompt_text = front.detokenize.decode(req.prompt_ids) if parsed.echo else ""
        return json_response(shape.body(prompt_text + gen.content, gen.finish_reason, lps,
                                        gen.usage))


async def _stream(http: sanic.Request, gen: Generation, shape: Any, parsed: oa.Parsed,
                  chat: bool) -> bool:
    """Send the SSE stream; False when it ended with an error event."""
    response = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
    if chat:
        await response.send(sse_data(shape.chunk({"role": "assistant", "content": ""})))
    try:
        async for delta in gen.deltas():
            if not delta:
                await response.send(b": keep-alive\n\n")
                continue
            if not chat:
                await response.send(sse_data(shape.chunk(delta.content, lps=delta.logprobs)))
                continue
            parts = oa.chat_deltas(delta) or [{"content": ""}]   # logprobs of held-back text
            for i, part in enumerate(parts):
                lps = delta.logprobs if i == 0 else None
                await response.send(sse_data(shape.chunk(part, lps=lps)))
    except ServeError as e:
        await response.send(sse_data(oa.error_body(e.message, e.error_type, e.param, e.code)))
        await response.send(b"data: [DONE]\n\n")
        await response.eof()
        return False
    final_usage = None if parsed.include_usage else gen.usage
    last = {} if chat else ""
    await response.send(sse_data(shape.chunk(last, gen.finish_reason, usage=final_usage)))
    if parsed.include_usage:
        await response.send(sse_data(shape.usage_chunk(gen.usage)))
    await response.send(b"data: [DONE]\n\n")
    await response.eof()
    return True
