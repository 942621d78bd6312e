"""Anthropic requests: /v1/messages and /v1/messages/count_tokens bodies → PromptInput and the
requested sampling: the system prompt (and system turns folded into it), each turn's text,
image, tool_use, tool_result and thinking blocks as template messages, cache_control marks as
prompt-cache breakpoints, tools and tool_choice, thinking and its budget. Bad input is an
InvalidRequest naming the field. Event loop; pure Python."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.http.api import fields as F
from pipeserve.http.api.openai import sampling_fields
from pipeserve.request import PromptInput, Requested
from pipeserve.vision.media import MediaPart, from_base64, from_url

MAX_BREAKPOINTS = 4   # Anthropic's limit on cache_control blocks
TTLS = {"5m": 300.0, "1h": 3600.0}


def parse(body: dict[str, Any], count_only: bool = False) -> tuple[PromptInput, Requested]:
    """The body → its prompt and (unless `count_only`: count_tokens) its requested sampling."""
    messages = F.get(body, "messages", list)
    if not messages:
        raise InvalidRequest("messages must be a non-empty array of {role, content} turns",
                             param="messages")
    media: list[MediaPart] = []
    turns, breakpoints = _turns(body, messages, media)
    tools = [F.anthropic_tool(t, f"tools[{i}]", "tools")
             for i, t in enumerate(F.get(body, "tools", list) or [])]
    choice, name = _tool_choice(F.get(body, "tool_choice", dict), tools)
    kwargs = dict(F.get(body, "chat_template_kwargs", dict) or {})
    thinking_budget = _thinking(body, kwargs)
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
        return inputs, Requested()
    requested = sampling_fields(body, "stop_sequences")
    max_tokens = F.get(body, "max_tokens", int)
    if max_tokens is None:
        raise InvalidRequest("max_tokens is required: send the most tokens to generate, "
                             "a positive integer", param="max_tokens")
    return inputs, replace(requested, max_tokens=max_tokens)


def _turns(body: dict[str, Any], messages: list[Any],
           media: list[MediaPart]) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
    """The template messages (the system prompt first) and the cache_control breakpoints
    among them: (index of the message a breakpoint ends, its TTL in seconds)."""
    turns = _system(body.get("system"), _folded(messages))
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
    return turns, breakpoints


def _thinking(body: dict[str, Any], kwargs: dict[str, Any]) -> int | None:
    """`thinking`: its type sets enable_thinking in `kwargs` (unless the request's
    chat_template_kwargs did); the reasoning budget it (or max_reasoning_tokens) asks."""
    thinking = F.get(body, "thinking", dict)
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise InvalidRequest(f"thinking.type is {kind!r}; allowed: enabled, disabled, "
                                 "adaptive", param="thinking")
        kwargs.setdefault("enable_thinking", kind != "disabled")
    return _thinking_budget(thinking, body)


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
