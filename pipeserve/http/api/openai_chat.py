"""OpenAI chat requests: a /v1/chat/completions body → Parsed: its messages as template
messages (text, image, video and audio parts; tool calls with their arguments as objects; the
reasoning a client sends back), tools and tool_choice, reasoning effort, logprobs, structured
output and the sampling fields. Bad input is an InvalidRequest naming the field. Event loop;
pure Python."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.http.api import cache_key, structured
from pipeserve.http.api import fields as F
from pipeserve.http.api.openai import MAX_CHOICES, Parsed, sampling_fields, stream_flags
from pipeserve.http.api.reasoning import thinking_from_effort
from pipeserve.request import PromptInput
from pipeserve.vision import video
from pipeserve.vision.audio import from_input_audio
from pipeserve.vision.media import MediaPart, from_url

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: dict[str, Any]) -> Parsed:
    messages = F.get(body, "messages", list)
    if not messages:
        raise InvalidRequest("messages must be a non-empty array of chat messages",
                             param="messages")
    requested = sampling_fields(body, max_n=MAX_CHOICES)
    max_tokens = F.get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = F.get(body, "max_tokens", int)
    logprobs = F.get(body, "logprobs", bool, False)
    top = F.get(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    requested = replace(requested, max_tokens=max_tokens, logprobs=logprobs,
                        top_logprobs=top or 0)
    constraint = structured.from_body(body)
    tools = [F.function_tool(t, f"tools[{i}]", "tools")
             for i, t in enumerate(F.get(body, "tools", list) or [])]
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    kwargs = dict(F.get(body, "chat_template_kwargs", dict) or {})
    effort = F.get(body, "reasoning_effort", str)
    if effort is not None:
        kwargs.setdefault("enable_thinking", thinking_from_effort(effort, "reasoning_effort"))
        kwargs.setdefault("reasoning_effort", effort)
    stream, include, resume = stream_flags(body)
    continue_final = F.get(body, "continue_final_message", bool, False)
    if continue_final and (not isinstance(messages[-1], dict)
                           or messages[-1].get("role") != "assistant"):
        raise InvalidRequest("continue_final_message needs the last message to be the assistant's "
                             f"(got role {messages[-1].get('role') if isinstance(messages[-1], dict) else None!r})",
                             param="continue_final_message")
    media: list[MediaPart] = []
    turns = [_message(m, i, media) for i, m in enumerate(messages)]
    return Parsed(PromptInput(messages=turns, tools=tools or None, template_kwargs=kwargs,
                              tool_choice=choice, tool_name=name, media=media,
                              parallel_tool_calls=F.get(body, "parallel_tool_calls", bool, True),
                              reasoning_budget=F.reasoning_budget(body),
                              continue_final=continue_final,
                              cache_breakpoints=cache_key.pin(body, turns)[1]),
                  requested, stream, include, constraint=constraint, n=F.get(body, "n", int, 1),
                  resumable=resume)


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    """OpenAI tool_choice: "none" | "auto" | "required" | {"type": "function",
    "function": {"name"}} → (choice, forced tool name)."""
    if value is None or value in ("none", "auto", "required"):
        return F.tool_choice(value or "auto", None, tools, "tool_choice")
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or "
                             f'{{"type": "function", "function": {{"name": ...}}}}, got '
                             f"{F.short(value, 80)}", param="tool_choice")
    return F.tool_choice("named", fn["name"], tools, "tool_choice")


def _message(m: Any, i: int, media: list[MediaPart]) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object with role and content", param="messages")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role is {role!r}; allowed: {', '.join(ROLES)}",
                             param="messages")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _content(m.get("content"), where, media)}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "assistant":   # the reasoning a client sends back, for templates that render it
        for key in ("reasoning_content", "reasoning"):
            if isinstance(m.get(key), str) and m[key]:
                out["reasoning_content"] = m[key]
                break
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be an array of tool calls, got "
                             f"{F.short(calls)}", param="messages")
    if calls:
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _content(content: Any, where: str, media: list[MediaPart]) -> str | list[dict[str, Any]]:
    """A message's content: a string, or (with image or video parts) the parts a chat template
    renders, each image as {"type": "image"} (a video as {"type": "video"}) and its bytes
    appended to `media`."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or an array of parts",
                             param="messages")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind in ("image_url", "input_image"):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            media.append(from_url(url, at))
            parts.append({"type": "image"})
            continue
        if kind in video.KINDS:
            media.append(video.from_url(video.part_url(part), at))
            parts.append({"type": "video"})
            continue
        if kind == "input_audio":
            media.append(from_input_audio(part.get("input_audio"), at))
            parts.append({"type": "audio"})
            continue
        if kind in ("audio", "file"):
            raise InvalidRequest(
                f"{at} has type {kind!r}: this server takes text, image_url, video_url and "
                "input_audio parts only (GET /v1/models lists each model's modalities)",
                param=at)
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at} has type {kind!r}; allowed: text, image_url, video_url, "
                                 "input_audio",
                                 param="messages")
        parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"{where} needs function.name", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        args = F.json_text(args, f"{where}.function.arguments", "messages") if args.strip() else {}
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}.function.arguments must be a JSON object (or a string "
                             f"holding one), got {F.short(args)}", param="messages")
    F.check_depth(args, f"{where}.function.arguments", "messages")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}
