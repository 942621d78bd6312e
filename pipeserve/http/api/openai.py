"""What every OpenAI-shaped endpoint shares: the parsed request (Parsed), the sampling fields
(chat, completions, responses and anthropic read them), the stream flags, each choice's seed,
and the bodies of a tool call and an error. Chat bodies are parsed in openai_chat.py,
completions bodies in openai_completions.py, responses shaped in openai_shape.py. Event loop;
pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import Constraint
from pipeserve.http.api import fields as F
from pipeserve.http.api.resume import resumable
from pipeserve.http.api.tools import ToolCall
from pipeserve.request import PromptInput, Requested

MAX_CHOICES = 128   # OpenAI's bound on `n`


@dataclass
class Parsed:
    inputs: PromptInput
    requested: Requested
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
                    max_n: int = 1) -> Requested:
    """Sampling fields shared by every endpoint (OpenAI's plus mlx-lm/vLLM extensions); `n`
    is checked against `max_n` (1 where the protocol has one output per request)."""
    bias = F.logit_bias(body)
    out = Requested(
        temperature=F.get(body, "temperature", float),
        top_p=F.get(body, "top_p", float),
        top_k=F.get(body, "top_k", int),
        min_p=F.get(body, "min_p", float),
        repetition_penalty=F.get(body, "repetition_penalty", float),
        penalty_context_size=F.get(body, "repetition_context_size", int),
        presence_penalty=F.get(body, "presence_penalty", float),
        frequency_penalty=F.get(body, "frequency_penalty", float),
        xtc_probability=F.get(body, "xtc_probability", float),
        xtc_threshold=F.get(body, "xtc_threshold", float),
        seed=F.seed(body),
        logit_bias=tuple(bias.items()) if bias is not None else None,
        stop=tuple(F.stop_list(body, stop_field)),
        # scheduling (pipeserve/eventloop/latency.py): queue order, and a latency the answer must meet
        priority=body.get("priority"),
        deadline_ms=F.get(body, "deadline_ms", int),
    )
    n = F.get(body, "n", int, 1)
    if max_n == 1 and n != 1:
        raise InvalidRequest(f"n is {n}; this endpoint returns one output per request (n=1)",
                             param="n")
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n is {n}; allowed range is [1, {max_n}]", param="n")
    return out


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """stream, stream_options.include_usage, stream_options.resumable (pipeserve/http/api/resume.py)."""
    stream = F.get(body, "stream", bool, False)
    opts = F.get(body, "stream_options", dict) or {}
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean",
                             param="stream_options")
    return stream, include, resumable(body)


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{call.id}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
