"""Anthropic adapter: /v1/messages and /v1/messages/count_tokens bodies → Request, and
Generation output → Message bodies and the streaming event sequence (message_start,
content_block_*, message_delta, message_stop), errors in Anthropic's shape. Event loop."""
from __future__ import annotations

import re
import uuid
from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import known_fields
from pipeserve.http.api import fields as F
from pipeserve.http.api import resume
from pipeserve.http.api import structured
from pipeserve.http.api.generation import Delta, Generation, Usage
from pipeserve.http.api.tools import ToolCall
from pipeserve.http.api.http import (Scope, check_ready, json_response, read_body,
                               ready_front, route, sse_event)
from pipeserve.http.api.openai import incomplete_fields, miss_fields, sampling_fields
from pipeserve.http.api.resume import Frames, StreamLog
from pipeserve.errors import InvalidRequest, ServeError
from pipeserve.eventloop.offload import off_loop
from pipeserve.vision.media import MediaPart, from_base64, from_url
from pipeserve.request import PromptInput, Request

# HTTP status → Anthropic's error type: clients (Claude Code) pick their recovery by it
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 501: "invalid_request_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# our context-limit messages (pipeserve/stages/tokenize.py, admission.py) and Anthropic's own
# wording of the same, which Claude Code parses to compact or to retry with a smaller max_tokens
_PROMPT = re.compile(r"prompt has (\d+) tokens; the context limit is (\d+)")
_ROOM = re.compile(r"max_tokens is (\d+) but the prompt \((\d+) tokens\) leaves \d+ of the "
                   r"(\d+)-token context")


def error_body(message: str, error_type: str, status: int = 400,
               code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": _worded(message, code)}}


def _worded(message: str, code: str | None) -> str:
    """A context-limit error as Anthropic's API words it, ours after it."""
    if code != "context_length_exceeded":
        return message
    if m := _ROOM.search(message):
        asked, prompt, limit = m.groups()
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
                f"{limit}, decrease input length or `max_tokens` and try again ({message})")
    if m := _PROMPT.search(message):
        return f"prompt is too long: {m[1]} tokens > {m[2]} maximum ({message})"
    return message


# -- request -------------------------------------------------------------------------------
def parse(body: dict[str, Any], count_only: bool = False) -> tuple[PromptInput, dict[str, Any]]:
    messages = F.get(body, "messages", list)
    if not messages:
        raise InvalidRequest("messages must be a non-empty array of {role, content} turns",
                             param="messages")
    turns = _system(body.get("system"), _folded(messages))
    media: list[MediaPart] = []
    breakpoints = _breakpoints(body, turns)
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            continue   # folded into the system prompt above
        turns.extend(_turn(m, f"messages[{i}]", media))
        ttl = _marked(m.get("content") if isinstance(m, dict) else None, f"messages[{i}]")
        if ttl is not None:
            breakpoints.append((len(turns) - 1, ttl))
    marks = _num_marked(body)   # blocks, not breakpoints: several in one message count each
    if marks > MAX_BREAKPOINTS:
        raise InvalidRequest(f"{marks} blocks have cache_control; at most "
                             f"{MAX_BREAKPOINTS} may", param="cache_control")
    tools = [F.anthropic_tool(t, f"tools[{i}]", "tools")
             for i, t in enumerate(F.get(body, "tools", list) or [])]
    choice, name = _tool_choice(F.get(body, "tool_choice", dict), tools)
    kwargs = dict(F.get(body, "chat_template_kwargs", dict) or {})
    thinking = F.get(body, "thinking", dict)
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise InvalidRequest(f"thinking.type is {kind!r}; allowed: enabled, disabled, "
                                 "adaptive", param="thinking")
        kwargs.setdefault("enable_thinking", kind != "disabled")
    thinking_budget = _thinking_budget(thinking, body)
    disable = (F.get(body, "tool_choice", dict) or {}).get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise InvalidRequest("tool_choice.disable_parallel_tool_use must be a boolean",
                             param="tool_choice")
    inputs = PromptInput(messages=turns, tools=tools or None, template_kwargs=kwargs,
                         tool_choice=choice, tool_name=name, media=media,
                         parallel_tool_calls=not disable, cache_breakpoints=breakpoints,
                         reasoning_budget=thinking_budget,
                         # a final assistant turn is a prefill: the answer continues it
                         continue_final=messages[-1].get("role") == "assistant"
                         if isinstance(messages[-1], dict) else False)
    if count_only:
        return inputs, {}
    requested = sampling_fields(body, "stop_sequences")
    requested["max_tokens"] = F.get(body, "max_tokens", int)
    if requested["max_tokens"] is None:
        raise InvalidRequest("max_tokens is required: send the most tokens to generate, "
                             "a positive integer", param="max_tokens")
    return inputs, requested


MAX_BREAKPOINTS = 4   # Anthropic's limit on cache_control blocks
TTLS = {"5m": 300.0, "1h": 3600.0}


def _cache_control(value: Any, where: str) -> float | None:
    """A block's cache_control → its TTL in seconds (None: no breakpoint)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise InvalidRequest(f"{where}.cache_control must be {{\"type\": \"ephemeral\"}} "
                             f"(with an optional ttl), got {value!r:.80}", param="cache_control")
    ttl = value.get("ttl", "5m")
    if ttl not in TTLS:
        raise InvalidRequest(f"{where}.cache_control.ttl is {ttl!r}; allowed: 5m, 1h",
                             param="cache_control")
    return TTLS[ttl]


def _marked(blocks: Any, where: str) -> float | None:
    """The longest TTL among `blocks`' cache_control marks (None: no block is marked)."""
    if not isinstance(blocks, list):
        return None
    ttls = [_cache_control(b.get("cache_control"), f"{where}[{j}]")
            for j, b in enumerate(blocks) if isinstance(b, dict)]
    marked = [t for t in ttls if t is not None]
    return max(marked) if marked else None


def _num_marked(body: dict[str, Any]) -> int:
    """How many blocks (tools, system blocks, message content blocks) carry cache_control."""
    lists = [body.get("tools"), body.get("system")]
    lists += [m.get("content") for m in body.get("messages") or [] if isinstance(m, dict)]
    return sum(1 for blocks in lists if isinstance(blocks, list) for b in blocks
               if isinstance(b, dict) and b.get("cache_control") is not None)


def _breakpoints(body: dict[str, Any], system: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """cache_control on tools or system blocks: a breakpoint at the system message's end
    (tools are rendered with the system prompt). Tools without a system prompt: none."""
    ttls = [t for t in (_marked(body.get("tools"), "tools"),
                        _marked(body.get("system"), "system")) if t is not None]
    return [(0, max(ttls))] if ttls and system else []


def _system(system: Any, folded: list[str]) -> list[dict[str, Any]]:
    """The system prompt: `system` (a string or text blocks), then the `folded` texts of
    system entries sent inside `messages`."""
    if system is None or system == "":
        texts = []
    elif isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = ["\n".join(_text(b, f"system[{i}]", "system") for i, b in enumerate(system))]
    else:
        raise InvalidRequest("system must be a string or an array of text blocks", param="system")
    texts = [t for t in texts + folded if t]
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _folded(messages: list[Any]) -> list[str]:
    """The texts of `role: system` entries inside `messages` (Claude Code sends them for a
    model it does not know): they join the system prompt, which templates render first."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            blocks = _blocks(m.get("content"), f"messages[{i}]")
            out.append("".join(_text(b, f"messages[{i}].content[{j}]", "messages")
                               for j, b in enumerate(blocks)))
    return out


def _text(block: Any, where: str, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
            block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise InvalidRequest(f"{where} has type {kind!r}; expected a text block (this model "
                             "takes text only)", param=param)
    return block["text"]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or an array of content blocks",
                             param="messages")
    return content


def _turn(m: Any, where: str, media: list[MediaPart]) -> list[dict[str, Any]]:
    """One Anthropic turn → template messages: tool_result blocks become `tool` messages,
    tool_use blocks the assistant's tool_calls; thinking blocks are dropped."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role is {role!r}; allowed: user, assistant, system",
                             param="messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []   # text and image parts, when the turn has an image
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(m.get("content"), where)):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _result_text(block.get("content"), at)})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise InvalidRequest(f"{at} needs a string name and an object input",
                                     param="messages")
            F.check_depth(block.get("input", {}), f"{at}.input", "messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "image" and role == "user":
            media.append(_image(block, at))
            parts.append({"type": "image"})
        elif kind == "video":
            raise InvalidRequest(f"{at} has type 'video': Anthropic Messages has no video block; "
                                 "send videos as video_url parts to /v1/chat/completions",
                                 param=at)
        else:
            texts.append(_text(block, at, "messages"))
            parts.append({"type": "text", "text": texts[-1]})
    if texts or calls or parts or not out:
        content: Any = parts if any(p["type"] == "image" for p in parts) else "".join(texts)
        turn: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _image(block: dict[str, Any], where: str) -> MediaPart:
    """An image block: source {type: base64, media_type, data} or {type: url, url}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return from_base64(source.get("data"), where, source.get("media_type"))
    if kind == "url":
        return from_url(source.get("url"), where)
    raise InvalidRequest(f"{where} is an image block with source.type {kind!r}; allowed: base64, "
                         "url (or send a text block)", param=where)


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or text blocks", param="messages")
    return "".join(_text(b, f"{where}.content[{k}]", "messages") for k, b in enumerate(content))


def _thinking_budget(thinking: dict[str, Any] | None, body: dict[str, Any]) -> int | None:
    """thinking.budget_tokens (type enabled) and the max_reasoning_tokens extension: the
    tighter of those sent."""
    given = F.reasoning_budget(body)
    budget = (thinking or {}).get("budget_tokens")
    if (thinking or {}).get("type") != "enabled" or budget is None:
        return given
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise InvalidRequest(f"thinking.budget_tokens is {budget!r}; it must be a positive "
                             "integer", param="thinking.budget_tokens")
    return min(budget, given) if given is not None else budget


def _tool_choice(value: dict[str, Any] | None, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    kind = (value or {}).get("type", "auto")
    choice = ({"auto": "auto", "any": "required", "tool": "named", "none": "none"}.get(kind)
              if isinstance(kind, str) else None)
    if choice is None:
        raise InvalidRequest(f"tool_choice.type is {kind!r}; allowed: auto, any, tool, none",
                             param="tool_choice")
    name = (value or {}).get("name") if choice == "named" else None
    if choice == "named" and not isinstance(name, str):
        raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice")
    return F.tool_choice(choice, name, tools, "tool_choice")


# -- response ------------------------------------------------------------------------------
def stop_reason(gen: Generation) -> tuple[str, str | None]:
    if gen.finish_reason == "tool_calls":
        return "tool_use", None
    if gen.finish_reason == "length":
        return "max_tokens", None
    if gen.stop_sequence is not None:
        return "stop_sequence", gen.stop_sequence
    return "end_turn", None


def written(gen: Generation) -> int:
    """Prompt tokens up to the request's last cache_control breakpoint (0: none)."""
    return max((at for at, _ in gen.request.pins), default=0)


def usage_body(usage: Usage, output: bool = True, written: int = 0) -> dict[str, Any]:
    """Anthropic's accounting: input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens is the prompt. Read: what the cache supplied; creation: the
    tokens up to the request's last cache_control breakpoint (`written`) it did not."""
    created = max(0, written - usage.cached_tokens)
    out: dict[str, Any] = {"input_tokens": usage.prompt_tokens - usage.cached_tokens - created,
                           "cache_creation_input_tokens": created,
                           "cache_read_input_tokens": usage.cached_tokens,
                           "output_tokens": usage.completion_tokens if output else 0}
    if output:
        out.update(miss_fields(usage))
    if output and usage.speculation is not None:
        out["speculation"] = usage.speculation
    if output and usage.record is not None:
        out["pipeserve"] = usage.record
    if output:
        out.update(incomplete_fields(usage))
    return out


def message_body(message_id: str, model: str, gen: Generation) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for kind, part in gen.parts:   # in the order the model wrote them, as the stream's blocks
        if isinstance(part, ToolCall):
            content.append({"type": "tool_use", "id": f"toolu_{part.id}", "name": part.name,
                            "input": part.arguments})
        elif kind == "reasoning":
            content.append({"type": "thinking", "thinking": part, "signature": ""})
        else:
            content.append({"type": "text", "text": part})
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(gen)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(gen.usage, written=written(gen))}


class BlockStream:
    """Deltas → content_block_start/delta/stop events, opening a new block whenever the
    kind of output changes (thinking → text → tool_use)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def events(self, delta: Delta) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if delta.reasoning:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._ensure("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            out += self._ensure("tool_use", {"type": "tool_use", "id": f"toolu_{call.id}",
                                             "name": call.name, "input": {}}, fresh=True)
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": call.arguments_json}))
            out += self.close()
        return out

    def close(self, ensure_one: bool = False) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if ensure_one and self.index < 0:
            out += self._ensure("text", {"type": "text", "text": ""})
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        return out

    def _ensure(self, kind: str, block: dict[str, Any],
                fresh: bool = False) -> list[tuple[str, dict[str, Any]]]:
        if self.open == kind and not fresh:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                       "delta": delta}


# -- handlers ------------------------------------------------------------------------------
async def handle_messages(app: Sanic, http: sanic.Request) -> HTTPResponse | None:
    async with Scope(app, "messages", http) as scope:
        check_ready(app)
        body = await off_loop(len(http.body or b""), read_body, http)
        known_fields.check(app.ctx, http, "messages", body)
        inputs, requested = await off_loop(len(http.body or b""), parse, body)
        await scope.route(body)
        ctx = scope.ctx
        req = Request(request_id=f"msg_{uuid.uuid4().hex}", endpoint="messages",
                      inputs=inputs, requested=requested,
                      constraint=structured.from_body(body, format_field=None),   # guided_*
                      adapter=F.adapter(body, ctx.cfg.model.name, ctx.engine.limits.adapters))
        keep = resume.resumable(body)
        gen = await scope.start(req)
        model = ctx.cfg.model.name
        if F.get(body, "stream", bool, False):
            async def produce(log: StreamLog) -> None:
                scope.failed = not await _stream(log, gen, model)
            await resume.serve(http, app.ctx.streams, req.request_id, keep,
                               ctx.cfg.server.keep_alive_s, produce, scope.detach)
            return None
        await gen.run()
        return json_response(message_body(gen.request.request_id, model, gen))


async def handle_count_tokens(app: Sanic, http: sanic.Request) -> HTTPResponse:
    check_ready(app)
    body = await off_loop(len(http.body or b""), read_body, http)
    known_fields.check(app.ctx, http, "count_tokens", body)
    inputs, _ = await off_loop(len(http.body or b""), lambda: parse(body, True))
    front = ready_front(app, await route(app, body))
    req = await front.tokenize(front.normalise(Request(
        request_id=f"count-{uuid.uuid4().hex}", endpoint="count_tokens", inputs=inputs)))
    return json_response({"input_tokens": req.num_prompt_tokens})


async def _stream(log: StreamLog, gen: Generation, model: str) -> bool:
    """Append the event sequence to `log`; False when it ended with an error event. Events
    wait while the generation's next event is already here and go out in one write
    (resume.Frames); the last write also ends the response body."""
    out = Frames(log, gen)

    def send(events: list[tuple[str, dict[str, Any]]]) -> None:
        for name, data in events:
            out.add(sse_event(name, data))

    start = {"id": gen.request.request_id, "type": "message", "role": "assistant",
             "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": usage_body(gen.usage, output=False, written=written(gen))}
    send([("message_start", {"type": "message_start", "message": start}),
          ("ping", {"type": "ping"})])
    await out.flush_unless_ready()
    blocks = BlockStream()
    try:
        async for delta in gen.deltas():
            send(blocks.events(delta) if delta else [("ping", {"type": "ping"})])
            await out.flush_unless_ready()
    except ServeError as e:
        send([("error", error_body(e.message, e.error_type, e.status, e.code))])
        await out.flush(last=True)
        return False
    reason, sequence = stop_reason(gen)
    send(blocks.close(ensure_one=True) + [
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": usage_body(gen.usage, written=written(gen))}),
        ("message_stop", {"type": "message_stop"})])
    await out.flush(last=True)
    return True
