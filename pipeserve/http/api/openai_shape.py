"""OpenAI response shapes: a request's output → chat.completion and text_completion bodies
and their stream chunks (deltas in order: reasoning, content, tool calls; logprobs in the chat
and the legacy shapes; usage last), and the usage body with its extensions (cache misses,
calls cut by max_tokens, a clamped max_tokens) that the other protocols' usage reuses. Event
loop; pure Python."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeserve.http.api.generation import Delta, Usage
from pipeserve.http.api.openai import tool_call_body
from pipeserve.http.api.tools import ToolCall
from pipeserve.request import TokenLogprob

TokenInfo = Callable[[int], tuple[str, bytes]]


def usage_body(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, **miss_fields(usage)}}
    images = (usage.record or {}).get("image_tokens")
    videos = (usage.record or {}).get("video_tokens")
    audio = (usage.record or {}).get("audio_tokens")
    if images or videos or audio:   # OpenAI's split of the prompt: image, audio, text (+ video)
        details = out["prompt_tokens_details"]
        if images:
            details["image_tokens"] = images
        if audio:
            details["audio_tokens"] = audio
        if videos:
            details["video_tokens"] = videos
        details["text_tokens"] = (usage.prompt_tokens - (images or 0) - (videos or 0)
                                  - (audio or 0))
    if usage.reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    if usage.speculation is not None:
        out["speculation"] = usage.speculation
    if usage.record is not None:
        out["pipeserve"] = usage.record
    return {**out, **incomplete_fields(usage)}


def incomplete_fields(usage: Usage) -> dict[str, Any]:
    """Extensions: `incomplete_tool_call: true` when a call cut by max_tokens was dropped;
    `max_tokens_clamped`: the max_tokens in force when the one asked was more than fits."""
    out: dict[str, Any] = {"incomplete_tool_call": True} if usage.incomplete_call else {}
    if usage.max_tokens_clamped is not None:
        out["max_tokens_clamped"] = usage.max_tokens_clamped
    return out


def miss_fields(usage: Usage) -> dict[str, Any]:
    """Why prompt tokens were recomputed (an extension; absent when the cache held the whole
    prompt): `cache_miss_reason`, and `cache_miss` with its details (index, spans, age)."""
    if usage.cache_miss is None:
        return {}
    return {"cache_miss_reason": usage.cache_miss["reason"], "cache_miss": usage.cache_miss}


def chat_deltas(delta: Delta) -> list[dict[str, Any]]:
    """One Delta → the `delta` objects of chat.completion.chunk events, in order: reasoning,
    content, then per tool call its name (arguments "") and its arguments."""
    out: list[dict[str, Any]] = []
    if delta.reasoning:
        out.append({"reasoning_content": delta.reasoning})
    if delta.content:
        out.append({"content": delta.content})
    for call in delta.tool_calls:
        head = tool_call_body(call)
        head["function"]["arguments"] = ""
        out.append({"tool_calls": [{"index": call.index, **head}]})
        out.append({"tool_calls": [{"index": call.index,
                                    "function": {"arguments": call.arguments_json}}]})
    return out


@dataclass
class ChatShape:
    """Builds chat.completion bodies and chat.completion.chunk events for one request."""

    response_id: str
    model: str
    token_info: TokenInfo
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))

    def logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, lp: float) -> dict[str, Any]:
            text, raw = self.token_info(token_id)
            return {"token": text, "logprob": lp, "bytes": list(raw)}
        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps],
                "refusal": None}

    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              lps: list[TokenLogprob] | None = None, usage: Usage | None = None,
              index: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": self.logprobs(lps) if lps else None,
                         "finish_reason": finish}]}
        if usage is not None:
            out["usage"] = usage_body(usage)
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.response_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [], "usage": usage_body(usage)}

    def choice(self, index: int, text: str, finish: str, lps: list[TokenLogprob] | None,
               reasoning: str = "", calls: list[ToolCall] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [tool_call_body(c) for c in calls]
        return {"index": index, "message": message,
                "logprobs": self.logprobs(lps) if lps is not None else None,
                "finish_reason": finish}

    def body(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {"id": self.response_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": choices, "usage": usage_body(usage)}


@dataclass
class CompletionShape:
    """Builds text_completion bodies and stream events (legacy logprobs shape)."""

    response_id: str
    model: str
    token_info: TokenInfo
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)   # per choice: characters so far

    def logprobs(self, lps: list[TokenLogprob], index: int = 0) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for t in lps:
            text, _ = self.token_info(t.token_id)
            tokens.append(text)
            values.append(t.logprob)
            top: dict[str, float] = {}
            for i, v in t.top:   # tokens sharing a text (byte pieces): keep the likeliest
                top.setdefault(self.token_info(i)[0], v)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def chunk(self, text: str, finish: str | None = None, lps: list[TokenLogprob] | None = None,
              usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.response_id, "object": "text_completion", "created": self.created,
            "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": [{"index": index, "text": text,
                         "logprobs": self.logprobs(lps, index) if lps else None,
                         "finish_reason": finish}]}
        if usage is not None:
            out["usage"] = usage_body(usage)
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [],
                "usage": usage_body(usage)}

    def choice(self, index: int, text: str, finish: str,
               lps: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"index": index, "text": text,
                "logprobs": self.logprobs(lps, index) if lps is not None else None,
                "finish_reason": finish}

    def body(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": choices, "usage": usage_body(usage)}
