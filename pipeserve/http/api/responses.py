"""OpenAI Responses adapter: /v1/responses bodies (input string or items, instructions,
tools, previous_response_id) → Request, the handlers for create / retrieve / delete, and the
conversation kept in the ResponseStore. Event loop."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import known_fields
from pipeserve.http.api import fields as F
from pipeserve.http.api import resume
from pipeserve.http.api import structured
from pipeserve.http.api.generation import Generation
from pipeserve.http.api.http import (Scope, check_ready, json_response, read_body, ready_front,
                                     route, sse_event)
from pipeserve.http.api.openai import sampling_fields, tool_call_body
from pipeserve.http.api.reasoning import thinking_from_effort
from pipeserve.http.api.responses_shape import ResponseEvents, ResponseShape
from pipeserve.http.api.responses_input import conversation_media, input_messages
from pipeserve.http.api.responses_tools import ResponseTools, parse_tools
from pipeserve.http.api.resume import StreamLog
from pipeserve.http.api import cache_key
from pipeserve.http.api import responses_background as background
from pipeserve.http.api import background_resume
from pipeserve.http.api.store import ResponseStore
from pipeserve.errors import InvalidRequest, NotFound, ServeError
from pipeserve.grammar.constraint import Constraint
from pipeserve.eventloop.offload import off_loop
from pipeserve.request import PromptInput, Request

log = logging.getLogger("pipeserve")


@dataclass
class Parsed:
    inputs: PromptInput
    requested: dict[str, Any]
    conversation: list[dict[str, Any]]   # template messages without the instructions
    echo: dict[str, Any] = field(default_factory=dict)   # request fields the body repeats
    stream: bool = False
    store: bool = True
    constraint: Constraint | None = None   # text.format / guided_* (structured output)
    tools: ResponseTools = field(default_factory=ResponseTools)
    background: bool = False


def parse(body: dict[str, Any], store: ResponseStore | _Looked, strict: bool = False) -> Parsed:
    history: list[dict[str, Any]] = []
    previous = F.get(body, "previous_response_id", str)
    if previous is not None:
        item = store.get(previous)
        if item is None:
            raise NotFound(f"previous_response_id {previous!r} is unknown or expired (responses "
                           "are kept for server.responses_ttl_s and within "
                           "server.responses_store_mb)", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(item.conversation)
    conversation = history + input_messages(body.get("input"))
    instructions = F.get(body, "instructions", str)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    served = parse_tools(F.get(body, "tools", list) or [], strict)
    tools = served.tools
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    kwargs = dict(F.get(body, "chat_template_kwargs", dict) or {})
    reasoning = F.get(body, "reasoning", dict) or {}
    effort = reasoning.get("effort")
    if effort is not None:
        kwargs.setdefault("enable_thinking", thinking_from_effort(effort, "reasoning.effort"))
        kwargs.setdefault("reasoning_effort", effort)
    constraint, fmt = structured.from_text_format(body)
    requested = sampling_fields(body)
    requested["max_tokens"] = F.get(body, "max_output_tokens", int)
    parallel = F.get(body, "parallel_tool_calls", bool, True)
    truncation = F.get(body, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise InvalidRequest(f"truncation is {F.short(truncation)}; allowed: auto, disabled",
                             param="truncation")
    echo = {"instructions": instructions, "parallel_tool_calls": parallel,
            "truncation": truncation, "max_output_tokens": requested["max_tokens"],
            "previous_response_id": previous, "tool_choice": body.get("tool_choice") or "auto",
            "tools": served.echo,
            "metadata": F.check_depth(F.get(body, "metadata", dict) or {}, "metadata", "metadata"),
            "reasoning": {"effort": effort, "summary": _summary(reasoning)},
            "text": {"format": fmt}}
    user = F.get(body, "user", str)
    if user is not None:   # OpenAI's Response omits `user` when none was given
        echo["user"] = user
    echo["background"] = F.get(body, "background", bool, False)
    cache_echo, pins = cache_key.pin(body, messages)   # the session's history kept in cache
    echo.update(cache_echo)
    inputs = PromptInput(messages=messages, tools=tools or None, template_kwargs=kwargs,
                         tool_choice=choice, tool_name=name, media=conversation_media(messages),
                         parallel_tool_calls=parallel, reasoning_budget=F.reasoning_budget(body),
                         cache_breakpoints=pins)
    return Parsed(inputs, requested, conversation, echo, F.get(body, "stream", bool, False),
                  F.get(body, "store", bool, True), constraint, served, echo["background"])


SUMMARIES = ("auto", "concise", "detailed")
NO_SUMMARY = ("reasoning.summary: this server writes no summary; the reasoning comes whole as "
              "the reasoning item's reasoning_text")


def _summary(reasoning: dict[str, Any]) -> str | None:
    """reasoning.summary, checked and echoed as sent (the handler names it as not produced)."""
    summary = reasoning.get("summary")
    if summary is not None and summary not in SUMMARIES:
        raise InvalidRequest(f"reasoning.summary is {F.short(summary)}; allowed: "
                             f"{', '.join(SUMMARIES)}", param="reasoning.summary")
    return summary


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None or value in ("none", "auto", "required"):
        return F.tool_choice(value or "auto", None, tools, "tool_choice")
    if not isinstance(value, dict) or value.get("type") not in ("function", "custom") or \
            not isinstance(value.get("name"), str):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             '{"type": "function" | "custom", "name": ...}, got '
                             f"{F.short(value, 80)}", param="tool_choice")
    return F.tool_choice("named", value["name"], tools, "tool_choice")




# -- handlers ------------------------------------------------------------------------------
class _Looked:
    """The response store as parse sees it off the loop: the one entry the body's
    previous_response_id names, looked up on the loop beforehand."""

    def __init__(self, body: dict[str, Any], store: ResponseStore) -> None:
        previous = body.get("previous_response_id")
        self.id = previous
        self.item = store.get(previous) if isinstance(previous, str) else None

    def get(self, response_id: str) -> Any:
        return self.item if response_id == self.id else None


async def handle_create(app: Sanic, http: sanic.Request) -> HTTPResponse | None:
    async with Scope(app, "responses", http) as scope:
        check_ready(app)
        # the JSON and its validation off the loop when large; the response store (event loop
        # only) is read here, and parse gets the one entry it may ask for
        size = len(http.body or b"")
        body = await off_loop(size, read_body, http)
        known_fields.check(app.ctx, http, "responses", body)
        parsed = await off_loop(size, parse, body, _Looked(body, app.ctx.responses),
                                app.ctx.cfg.server.strict_fields)
        await scope.route(body)
        ctx = scope.ctx
        adapter = F.adapter(body, ctx.cfg.model.name, ctx.engine.limits.adapters)
        if parsed.background:
            _background_checks(parsed, ctx.cfg.admission.priority_classes)
        resumed = await background_resume.resuming(app, http) if parsed.background else None
        rid = resumed[0]["id"] if resumed is not None else f"resp_{uuid.uuid4().hex}"

        def make() -> Request:
            req = Request(request_id=rid, endpoint="responses",
                          inputs=parsed.inputs, requested=dict(parsed.requested),
                          constraint=parsed.constraint, adapter=adapter)
            dropped = parsed.tools.warning()
            if dropped is not None:
                req.warnings.append(dropped)
            if parsed.echo["reasoning"]["summary"] is not None:
                req.warnings.append(NO_SUMMARY)
            return req
        keep = resume.resumable(body)
        try:
            gen = await _start(scope, make, parsed,
                               resumed[0].get("output_ids") if resumed is not None else None)
        except BaseException:
            if resumed is not None:
                resumed[1].close()
            raise
        req = gen.request
        shape = ResponseShape(gen.request.request_id, ctx.cfg.model.name, parsed.echo,
                              gen.request.sampling, parsed.store, parsed.tools.custom)
        persisted = None
        if parsed.background:   # on disk until it ends: a restart resumes it
            if resumed is not None:
                shape.created_at = resumed[0]["created_at"]
            persisted = await background.Persisted.new(app, rid, body, shape.created_at,
                                                       resumed)

        def save(b: dict[str, Any]) -> list[dict[str, Any]]:
            return _save(app.ctx.responses, b, parsed.conversation, gen)
        if parsed.stream:
            async def produce(log: StreamLog) -> None:
                if persisted is not None:   # stored as it goes; POST .../cancel stops the task
                    final = await background.streamed(
                        app, gen, shape, save, persisted,
                        lambda: _stream(log, gen, shape, persisted.tick))
                else:
                    final = await _stream(log, gen, shape)
                scope.failed = final["status"] == "failed"
                if not scope.failed and parsed.store:   # stored even when the client left
                    save(final)
            await resume.serve(http, app.ctx.streams, req.request_id, keep,
                               ctx.cfg.server.keep_alive_s, produce, scope.detach,
                               background=parsed.background)
            return None
        if persisted is not None:
            return await background.launch(app, scope, gen, shape, save, persisted,
                                           resumed=resumed is not None)
        await gen.run()
        body = shape.body(shape.output(gen), gen)
        if parsed.store:
            _save(app.ctx.responses, body, parsed.conversation, gen)
        return json_response(body)


async def handle_input_tokens(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """POST /v1/responses/input_tokens: the prompt's token count of a Responses body, equal to
    the input_tokens a request with the same body reports."""
    check_ready(app)
    size = len(http.body or b"")
    body = await off_loop(size, read_body, http)
    known_fields.check(app.ctx, http, "responses", body)
    parsed = await off_loop(size, parse, body, _Looked(body, app.ctx.responses),
                            app.ctx.cfg.server.strict_fields)
    front = ready_front(app, await route(app, body))
    req = await front.tokenize(front.normalise(Request(
        request_id=f"count-{uuid.uuid4().hex}", endpoint="count_tokens", inputs=parsed.inputs,
        constraint=parsed.constraint)))
    return json_response({"object": "response.input_tokens",
                          "input_tokens": req.num_prompt_tokens})


def _background_checks(parsed: Parsed, classes: dict[str, int]) -> None:
    """A background response is read back from the store, and runs behind interactive work."""
    if not parsed.store:
        raise InvalidRequest("background is true with store false; a background response is "
                             "polled from the store: send store true", param="store")
    if parsed.requested.get("priority") is None:
        parsed.requested["priority"] = background.least_urgent(classes)


MAX_TRUNCATIONS = 256   # oldest turns truncation "auto" drops at most


async def _start(scope: Scope, make: Callable[[], Request], parsed: Parsed,
                 resumed: list[int] | None = None) -> Generation:
    """Start a request built by `make()`; `resumed`: output ids a restart checkpointed, which
    its prompt continues. truncation "auto": while its prompt is past the context, drop the
    conversation's oldest turn and try again, and say so."""
    dropped = 0
    for _ in range(MAX_TRUNCATIONS):
        try:
            req = await scope.prepare(make())
        except InvalidRequest as e:
            if (e.code != "context_length_exceeded" or parsed.echo["truncation"] != "auto"
                    or not _drop_oldest(parsed.inputs)):
                raise
            dropped += 1
            continue
        ids = background_resume.continuation(req, resumed or [])
        gen = scope.submit(req)
        if ids:
            gen.resume(ids)
        if dropped:
            gen.request.warnings.append(f"truncation auto: the {dropped} oldest turn(s) of the "
                                        "input were dropped to fit the context")
        return gen
    raise InvalidRequest(f"truncation auto dropped {MAX_TRUNCATIONS} turns and the input is "
                         "still past the context; shorten it", param="input",
                         code="context_length_exceeded")


def _drop_oldest(inputs: PromptInput) -> bool:
    """Drop the first turn after the system messages, and what answers it, up to the next user
    message; False when only the last user turn is left."""
    messages = inputs.messages or []
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    end = first + 1
    while end < len(messages) and messages[end]["role"] != "user":
        end += 1
    if end >= len(messages):
        return False
    inputs.messages = messages[:first] + messages[end:]
    inputs.media = conversation_media(inputs.messages)
    return True


def _save(store: ResponseStore, body: dict[str, Any], conversation: list[dict[str, Any]],
          gen: Generation) -> list[dict[str, Any]]:
    """Store the response with its conversation (returned)."""
    turn: dict[str, Any] = {"role": "assistant", "content": gen.content}
    if gen.tool_calls:
        turn["tool_calls"] = [tool_call_body(c) for c in gen.tool_calls]
        for call in turn["tool_calls"]:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    stored = conversation + [turn]
    if not store.put(body["id"], body, stored):
        log.warning("response %s is larger than server.responses_store_mb; not stored",
                    body["id"])
    return stored


async def _stream(log: StreamLog, gen: Generation, shape: ResponseShape,
                  tick: Callable[[Generation], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Append the event chain to `log`; the final response body (status "failed" after an
    error). `tick`: awaited after each delta (a background response's checkpoints)."""
    events = ResponseEvents(shape)

    async def send(batch: list[dict[str, Any]]) -> None:
        for event in batch:
            await log.put(sse_event(event["type"], event))

    await send(events.begin())
    try:
        async for delta in gen.deltas():
            if delta:
                await send(events.feed(delta))
            if tick is not None:
                await tick(gen)
    except ServeError as e:
        failed = events.fail(e)
        await send(failed)
        return failed[-1]["response"]
    final = events.end(gen)
    await send(final)
    return final[-1]["response"]


async def handle_get(app: Sanic, http: sanic.Request, response_id: str) -> HTTPResponse | None:
    if http.args.get("stream") == "true":   # OpenAI's resume: ?stream=true&starting_after=N
        await resume.resume(http, app.ctx.streams, response_id, app.ctx.cfg.server.keep_alive_s)
        return None
    item = app.ctx.responses.get(response_id)
    if item is None:
        raise NotFound(f"response {response_id!r} is unknown or expired", param="response_id")
    return json_response(item.body)


async def handle_delete(app: Sanic, http: sanic.Request, response_id: str) -> HTTPResponse:
    on_disk = await asyncio.to_thread(app.ctx.background_store.delete, response_id)
    if not app.ctx.responses.delete(response_id) and not on_disk:
        raise NotFound(f"response {response_id!r} is unknown or expired", param="response_id")
    return json_response({"id": response_id, "object": "response", "deleted": True})
