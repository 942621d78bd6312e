"""The `input` of a Responses body → template messages: message items become turns (text
parts joined, or the image / video / audio parts a template renders), function_call and
custom_tool_call items the assistant's tool_calls, reasoning items its reasoning,
*_output items `tool` messages. Event loop (or its offload threads)."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.http.api import fields as F
from pipeserve.http.api.responses_reasoning import reasoning_text, think
from pipeserve.http.api.responses_tools import INPUT
from pipeserve.vision import video
from pipeserve.vision.audio import from_input_audio
from pipeserve.vision.media import MediaPart, from_url

ROLES = ("user", "system", "developer", "assistant")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` → template messages: message items become turns, function_call items the
    assistant's tool_calls, function_call_output items `tool` messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty array of items",
                             param="input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []   # reasoning items not yet given to an assistant turn
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append(_message(item, where))
            if out[-1]["role"] == "assistant":
                think(out[-1], reasoning)
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where) if kind == "function_call" else _custom_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            think(out[-1], reasoning)
        elif kind == "reasoning":
            reasoning += reasoning_text(item, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": text})
        else:
            raise InvalidRequest(f"{where}.type is {kind!r}; supported: message, function_call, "
                                 "function_call_output, custom_tool_call, "
                                 "custom_tool_call_output, reasoning", param="input")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role is {role!r}; allowed: {', '.join(ROLES)}",
                             param="input")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts(parts: Any, where: str) -> str | list[dict[str, Any]]:
    """Text parts joined; with an input_image (input_video), the parts a template renders —
    each image (video) keeps its URL and where it was sent, so a stored conversation carries it
    to the next turn."""
    if not isinstance(parts, list) or not any(
            isinstance(p, dict) and p.get("type") in ("input_image", "input_audio", *video.KINDS)
            for p in parts):
        return _text(parts, where)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            out.append({"type": "image", "image_url": url, "where": at})
        elif isinstance(part, dict) and part.get("type") in video.KINDS:
            out.append({"type": "video", "video_url": video.part_url(part), "where": at})
        elif isinstance(part, dict) and part.get("type") == "input_audio":
            from_input_audio(part.get("input_audio"), at)   # refused now, not at the next turn
            out.append({"type": "audio", "input_audio": part["input_audio"], "where": at})
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                    part.get("text"), str):
                raise InvalidRequest(f"{at} has type {kind!r}; allowed: input_text, input_image, "
                                     "input_video, input_audio", param="input")
            out.append({"type": "text", "text": part["text"]})
    return out


def conversation_media(messages: list[dict[str, Any]]) -> list[MediaPart]:
    """The images, videos and audio clips of the whole conversation (history included), in
    prompt order."""
    def part(p: dict[str, Any]) -> MediaPart:
        if p["type"] == "image":
            return from_url(p["image_url"], p["where"])
        if p["type"] == "video":
            return video.from_url(p["video_url"], p["where"])
        return from_input_audio(p["input_audio"], p["where"])
    return [part(p) for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") in ("image", "video", "audio")]


def _text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise InvalidRequest(f"{where} must be a string or an array of text parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{j}] has type {kind!r}; this model takes text parts "
                                 "only", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(args, str):
        raise InvalidRequest(f"{where} needs a string name and string arguments", param="input")
    arguments = F.json_text(args, f"{where}.arguments", "input") if args.strip() else {}
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments must hold a JSON object, got "
                             f"{F.short(arguments)}", param="input")
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _custom_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool's call: its freeform `input` is the call's one argument."""
    name, text = item.get("name"), item.get("input")
    if not isinstance(name, str) or not isinstance(text, str):
        raise InvalidRequest(f"{where} needs a string name and a string input", param="input")
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": name, "arguments": {INPUT: text}}}
