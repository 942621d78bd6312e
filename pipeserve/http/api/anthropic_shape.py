"""Anthropic responses: a Generation → the Message body (content blocks in the order the
model wrote them, stop_reason, usage with the prompt cache's read and creation counts) and,
while it streams, its deltas → content_block_start / delta / stop events. Event loop; pure
Python."""
from __future__ import annotations

from typing import Any

from pipeserve.http.api.generation import Delta, Generation, Usage
from pipeserve.http.api.openai_shape import incomplete_fields, miss_fields
from pipeserve.http.api.tools import ToolCall


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
