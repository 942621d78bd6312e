"""Reasoning items in a Responses `input` (a client sending back the reasoning items of an
earlier response, as Codex does): their text goes to the assistant turn that follows them as
`reasoning_content`, where a chat template that keeps reasoning renders it. Pure Python."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import InvalidRequest


def reasoning_text(item: dict[str, Any], where: str) -> list[str]:
    """A reasoning item's text: its `content` reasoning_text parts, else its `summary`
    summary_text parts; none for one that carries only `encrypted_content` (another
    server's, which no template can render)."""
    # Codex writes a content part as reasoning_text or text
    for key, types in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") in types
                and isinstance(p.get("text"), str) for p in parts):
            raise InvalidRequest(f"{where}.{key} must be an array of "
                                 f'{{"type": "{types[0]}", "text": ...}} parts', param="input")
        if parts:
            return ["".join(p["text"] for p in parts)]
    return []


def think(turn: dict[str, Any], reasoning: list[str]) -> None:
    """The reasoning items before an assistant turn become its `reasoning_content`, which
    templates that keep reasoning (Qwen3's, after the last user turn) render as a think span."""
    if reasoning:
        turn["reasoning_content"] = "\n".join(filter(None, [turn.get("reasoning_content"),
                                                            *reasoning]))
        reasoning.clear()
