"""OpenAI chat and completions handlers: body → Request → Generation → JSON body or SSE
chunks (reasoning_content, content, tool_calls deltas; usage last). Event loop."""
from __future__ import annotations

import copy
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import completions_http
from pipeserve.http.api import fields as F
from pipeserve.http.api import known_fields
from pipeserve.http.api import openai as oa
from pipeserve.http.api import openai_shape as shapes
from pipeserve.http.api.openai_chat import parse_chat
from pipeserve.http.api.openai_completions import parse_completion
from pipeserve.http.api import resume
from pipeserve.http.api.generation import Choices, Delta, Generation, Usage
from pipeserve.http.api.resume import Frames, StreamLog
from pipeserve.http.api.http import Scope, check_ready, json_response, read_body, sse_data
from pipeserve.errors import AdmissionRejected, InvalidRequest, ServeError
from pipeserve.eventloop.offload import off_loop
from pipeserve.request import Request


async def handle(app: Sanic, http: sanic.Request, endpoint: str) -> HTTPResponse | None:
    """POST /v1/chat/completions (endpoint "chat") and /v1/completions ("completions")."""
    ctx = app.ctx
    async with Scope(app, endpoint, http) as scope:
        check_ready(app)
        chat = endpoint == "chat"
        parse = parse_chat if chat else parse_completion
        body = await off_loop(len(http.body or b""), read_body, http)
        known_fields.check(app.ctx, http, endpoint, body)
        parsed = await off_loop(len(http.body or b""), parse, body)
        front = await scope.route(body)
        ctx = scope.ctx
        adapter = F.adapter(body, ctx.cfg.model.name, ctx.engine.limits.adapters)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        fp = f"fp_{ctx.config_hash}"
        if not chat:
            completions_http.with_suffix(parsed, front)
        rows = parsed.n * len(parsed.prompts or [None])   # max_tokens 0 (scoring) runs none
        if rows > 1 and parsed.requested.max_tokens != 0:
            _check_room(ctx, rows)
        if not chat and not parsed.stream:   # prompt arrays, echo scoring, max_tokens 0
            shape = shapes.CompletionShape(rid, ctx.cfg.model.name, front.token_info, fp)
            return json_response(await completions_http.respond(scope, parsed, front, rid,
                                                                adapter, shape))
        # every choice is its own row: tokenized and admitted now (errors before any output)
        reqs = [await scope.prepare(_choice_request(parsed, rid, endpoint, i, adapter))
                for i in range(parsed.n)]
        prompt_ids = reqs[0].prompt_ids   # as sent: a preempted row's grows on the engine side
        gen = scope.submit(reqs[0], parse_output=chat)
        choices = _choices(scope, gen, reqs[1:], chat)
        shape: Any = (shapes.ChatShape if chat else shapes.CompletionShape)(
            rid, ctx.cfg.model.name, front.token_info, fp)
        if parsed.stream:
            await _serve_stream(scope, http, gen, choices, shape, parsed, chat, rid)
            return None
        return json_response(await _body(gen, choices, shape, parsed, chat, front, prompt_ids))


async def _serve_stream(scope: Scope, http: sanic.Request, gen: Generation,
                        choices: Choices | None, shape: Any, parsed: oa.Parsed, chat: bool,
                        rid: str) -> None:
    """The SSE response: its frames go through the resumable stream log (resume.py)."""
    gens = choices.gens if choices is not None else [gen]

    async def produce(log: StreamLog) -> None:
        try:
            scope.failed = not await _stream(log, gens, choices, shape, parsed, chat)
        finally:
            if choices is not None:
                choices.close()
    await resume.serve(http, scope.app.ctx.streams, rid, parsed.resumable,
                       scope.ctx.cfg.server.keep_alive_s, produce, scope.detach)


async def _body(gen: Generation, choices: Choices | None, shape: Any, parsed: oa.Parsed,
                chat: bool, front: Any, prompt_ids: list[int]) -> dict[str, Any]:
    """The JSON body once every choice has finished (with echo, the prompt as sent before
    each completion's text)."""
    try:
        async for _ in choices.deltas() if choices is not None else _one(gen):
            pass
    finally:
        if choices is not None:
            choices.close()
    gens = choices.gens if choices is not None else [gen]
    usage = Usage.total([g.usage for g in gens]) if len(gens) > 1 else gen.usage
    prompt_text = front.detokenize.decode(prompt_ids) if parsed.echo else ""
    out = []
    for i, g in enumerate(gens):
        lps = g.all_logprobs if g.request.sampling.logprobs else None
        out.append(shape.choice(i, g.content, g.finish_reason, lps, g.reasoning,
                                g.tool_calls) if chat else
                   shape.choice(i, prompt_text + g.content, g.finish_reason, lps))
    return shape.body(out, usage)


def _check_room(ctx: Any, n: int) -> None:
    """n choices are n rows: refuse (429) when the last of them would find the queue full,
    as admission refuses one request, so one large `n` cannot crowd out other clients; 400
    when even an idle server could not hold them (a retry cannot help)."""
    engine, cap = ctx.engine, ctx.cfg.admission.max_queue
    max_rows = engine.limits.max_rows
    most = cap + max_rows   # what an idle server admits: a larger n never fits
    if n > most:
        raise InvalidRequest(
            f"n is {n}; this server admits at most {most} choices per request "
            f"(scheduler.max_batch {max_rows} running + admission.max_queue {cap} "
            "waiting), so it can never run this request — lower n", param="n",
            code="n_over_limit")
    load = engine.load()
    ahead = max(0, load.num_waiting + n - 1 - max(0, max_rows - load.num_running))
    if ahead >= cap:
        ctx.metrics.admission.labels("rejected", "queue_full").inc()
        raise AdmissionRejected(
            f"n is {n}: its choices would queue {ahead} rows ahead of the last one, and "
            f"admission.max_queue is {cap} (scheduler.max_batch {max_rows} run at "
            "once); lower n or retry shortly", retry_after_s=1, code="queue_full")


def _choice_request(parsed: oa.Parsed, rid: str, endpoint: str, index: int,
                    adapter: str | None) -> Request:
    requested = parsed.requested
    if index:
        requested = replace(requested, seed=oa.choice_seed(requested.seed, index))
    return Request(request_id=rid if index == 0 else f"{rid}-{index}", endpoint=endpoint,
                   inputs=copy.deepcopy(parsed.inputs) if index else parsed.inputs,
                   requested=requested, constraint=parsed.constraint, adapter=adapter)


def _choices(scope: Scope, first: Generation, rest: list[Request],
             chat: bool) -> Choices | None:
    """n > 1: the choices after the first start once its prompt is prefilled and so in the
    prompt cache (with cache=off there is nothing to share: all start at once)."""
    if not rest:
        return None
    return Choices(first, lambda: [scope.submit(r, parse_output=chat) for r in rest],
                   wait_first=scope.ctx.cfg.cache.enabled)


async def _one(gen: Generation) -> AsyncIterator[tuple[int, Delta | None]]:
    async for delta in gen.deltas():
        yield 0, delta
    yield 0, None


async def _stream(log: StreamLog, gens: list[Generation], choices: Choices | None,
                  shape: Any, parsed: oa.Parsed, chat: bool) -> bool:
    """Append the SSE stream's frames to `log`; False when it ended with an error event. Each
    chunk carries its choice's `index`; each choice ends with its own finish_reason chunk.
    Frames wait in `out` while the next delta is already here (tokens the loop fell behind
    on, the last token with its finish chunk and [DONE]) and go out in one write."""
    out = Frames(log, gens[0] if choices is None else None)
    send = out.add
    if chat:
        for i in range(parsed.n):
            send(sse_data(shape.chunk({"role": "assistant", "content": ""}, index=i)))
        await out.flush_unless_ready()
    ended = 0
    try:
        async for i, delta in choices.deltas() if choices is not None else _one(gens[0]):
            if delta is None:   # choice i ended: its finish chunk (the last one: usage too)
                ended += 1
                usage = None
                if ended == parsed.n and not parsed.include_usage:
                    usage = Usage.total([g.usage for g in gens]) if len(gens) > 1 else gens[0].usage
                last: Any = {} if chat else ""
                send(sse_data(shape.chunk(last, gens[i].finish_reason, index=i, usage=usage)))
                if ended < parsed.n:   # after the last one, [DONE] joins it
                    await out.flush_unless_ready()
                continue
            if not delta:   # a keep-alive tick (the connection sends its own), or no text yet
                await out.flush_unless_ready()
                continue
            if not chat:
                send(sse_data(shape.chunk(delta.content, lps=delta.logprobs, index=i)))
            else:
                parts = shapes.chat_deltas(delta) or [{"content": ""}]   # logprobs of held-back text
                for j, part in enumerate(parts):
                    lps = delta.logprobs if j == 0 else None
                    send(sse_data(shape.chunk(part, lps=lps, index=i)))
            await out.flush_unless_ready()
    except ServeError as e:
        send(sse_data(oa.error_body(e.message, e.error_type, e.param, e.code)))
        send(b"data: [DONE]\n\n")
        await out.flush(last=True)
        return False
    if parsed.include_usage:
        usage = Usage.total([g.usage for g in gens]) if len(gens) > 1 else gens[0].usage
        send(sse_data(shape.usage_chunk(usage)))
    send(b"data: [DONE]\n\n")
    await out.flush(last=True)
    return True
