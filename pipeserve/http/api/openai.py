"""OpenAI adapter: /v1/chat/completions and /v1/completions bodies → Request fields, and
pieces of output → response bodies and stream chunks shaped as OpenAI's API reference.
Event loop; pure Python."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeserve.http.api import fields as F
from pipeserve.http.api import cache_key, structured
from pipeserve.http.api.generation import Delta, Usage
from pipeserve.http.api.reasoning import thinking_from_effort
from pipeserve.http.api.tools import ToolCall
from pipeserve.http.api.resume import resumable
from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import Constraint
from pipeserve.request import PromptInput, TokenLogprob
from pipeserve.vision import video
from pipeserve.vision.audio import from_input_audio
from pipeserve.vision.media import MediaPart, from_url

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 128   # OpenAI's bound on `n`
MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's own bound on the array)


@dataclass
class Parsed:
    inputs: PromptInput
    requested: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    constraint: Constraint | None = None   # response_format / guided_* (structured output)
    n: int = 1   # choices to generate, each its own row and random stream
    prompts: list[PromptInput] = field(default_factory=list)   # completions: every prompt
    suffix: str | None = None   # completions: text after the insertion (fill-in-the-middle)
    resumable: bool = False   # stream_options.resumable: the stream outlives its connection


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with `seed`: choice 0 keeps it (n=1 and
    choice 0 of n>1 agree); the others get distinct, deterministic seeds."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


def sampling_fields(body: dict[str, Any], stop_field: str = "stop",
                    max_n: int = 1) -> dict[str, Any]:
    """Sampling fields shared by every endpoint (OpenAI's plus mlx-lm/vLLM extensions); `n`
    is checked against `max_n` (1 where the protocol has one output per request)."""
    out = {
        "temperature": F.get(body, "temperature", float),
        "top_p": F.get(body, "top_p", float),
        "top_k": F.get(body, "top_k", int),
        "min_p": F.get(body, "min_p", float),
        "repetition_penalty": F.get(body, "repetition_penalty", float),
        "penalty_context_size": F.get(body, "repetition_context_size", int),
        "presence_penalty": F.get(body, "presence_penalty", float),
        "frequency_penalty": F.get(body, "frequency_penalty", float),
        "xtc_probability": F.get(body, "xtc_probability", float),
        "xtc_threshold": F.get(body, "xtc_threshold", float),
        "seed": F.seed(body),
        "logit_bias": F.logit_bias(body),
        "stop": F.stop_list(body, stop_field),
        # scheduling (pipeserve/eventloop/latency.py): queue order, and a latency the answer must meet
        "priority": body.get("priority"),
        "deadline_ms": F.get(body, "deadline_ms", int),
    }
    n = F.get(body, "n", int, 1)
    if max_n == 1 and n != 1:
        raise InvalidRequest(f"n is {n}; this endpoint returns one output per request (n=1)",
                             param="n")
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n is {n}; allowed range is [1, {max_n}]", param="n")
    return out


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """stream, stream_options.include_usage, stream_options.resumable (pipeserve/http/api/resume.py)."""
    stream = F.get(body, "stream", bool, False)
    opts = F.get(body, "stream_options", dict) or {}
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean",
                             param="stream_options")
    return stream, include, resumable(body)


def parse_chat(body: dict[str, Any]) -> Parsed:
    messages = F.get(body, "messages", list)
    if not messages:
        raise InvalidRequest("messages must be a non-empty array of chat messages",
                             param="messages")
    requested = sampling_fields(body, max_n=MAX_CHOICES)
    max_tokens = F.get(body, "max_completion_tokens", int)
    requested["max_tokens"] = max_tokens if max_tokens is not None else F.get(body, "max_tokens", int)
    logprobs = F.get(body, "logprobs", bool, False)
    top = F.get(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    requested["logprobs"] = logprobs
    requested["top_logprobs"] = top or 0
    constraint = structured.from_body(body)
    tools = [F.function_tool(t, f"tools[{i}]", "tools")
             for i, t in enumerate(F.get(body, "tools", list) or [])]
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    kwargs = dict(F.get(body, "chat_template_kwargs", dict) or {})
    effort = F.get(body, "reasoning_effort", str)
    if effort is not None:
        kwargs.setdefault("enable_thinking", thinking_from_effort(effort, "reasoning_effort"))
        kwargs.setdefault("reasoning_effort", effort)
    stream, include, resume = _stream_flags(body)
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


def _prompts(body: dict[str, Any]) -> list[PromptInput]:
    """`prompt`: a string, an array of token ids, or an array of either (one prompt each,
    as OpenAI's legacy completions take them)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        items, single = [prompt], True
    elif isinstance(prompt, list) and prompt:
        items, single = prompt, False
    else:
        raise InvalidRequest("prompt must be a string, an array of token ids, or a non-empty "
                             "array of strings or of token-id arrays", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt has {len(items)} prompts; the limit is {MAX_PROMPTS}",
                             param="prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(PromptInput(text=item))
        elif _token_ids(item):
            out.append(PromptInput(token_ids=list(item)))
        else:
            where = "prompt" if single else f"prompt[{i}]"
            raise InvalidRequest(f"{where} must be a string or a non-empty array of token ids, "
                                 f"got {F.short(item)}", param="prompt")
    return out


def _token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def parse_completion(body: dict[str, Any]) -> Parsed:
    prompts = _prompts(body)
    best_of = F.get(body, "best_of", int, 1)
    if best_of not in (1, F.get(body, "n", int, 1)):
        raise InvalidRequest(f"best_of is {best_of}; only best_of equal to n (or 1) is "
                             "supported: every generated choice is returned", param="best_of")
    requested = sampling_fields(body, max_n=MAX_CHOICES)
    requested["max_tokens"] = F.get(body, "max_tokens", int, 16)  # OpenAI's default here
    echo = F.get(body, "echo", bool, False)
    if requested["max_tokens"] == 0 and not echo:
        raise InvalidRequest("max_tokens is 0; that generates nothing, which only makes sense "
                             "with echo: true (to score the prompt); allowed range is [1, "
                             "context]", param="max_tokens")
    logprobs = F.get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise InvalidRequest(f"logprobs is {logprobs}; allowed range is [0, 5]", param="logprobs")
    requested["logprobs"] = logprobs is not None
    requested["top_logprobs"] = logprobs or 0
    stream, include, resume = _stream_flags(body)
    if stream and len(prompts) > 1:
        raise InvalidRequest(f"prompt has {len(prompts)} prompts; a streamed completion takes "
                             "one (send one request per prompt, or stream: false)",
                             param="prompt")
    if stream and requested["max_tokens"] == 0:
        raise InvalidRequest("max_tokens 0 (scoring the prompt) needs stream: false",
                             param="max_tokens")
    return Parsed(prompts[0], requested, stream, include, echo=echo,
                  constraint=structured.from_body(body), n=F.get(body, "n", int, 1),
                  prompts=prompts, suffix=F.get(body, "suffix", str), resumable=resume)


# -- responses -------------------------------------------------------------------------
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


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{call.id}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


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


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
