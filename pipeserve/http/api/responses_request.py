"""A /v1/responses body → Parsed: the prompt (instructions, the conversation
previous_response_id continues, the `input` items), tools and tool_choice, reasoning, text.format,
the sampling fields and the request fields the response body repeats. Event loop (or its offload
threads)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import Constraint
from pipeserve.http.api import cache_key
from pipeserve.http.api import fields as F
from pipeserve.http.api import structured
from pipeserve.http.api.openai import sampling_fields
from pipeserve.http.api.reasoning import thinking_from_effort
from pipeserve.http.api.responses_conversation import Looked, history
from pipeserve.http.api.responses_input import conversation_media, input_messages
from pipeserve.http.api.responses_tools import ResponseTools, parse_tools
from pipeserve.http.api.store import ResponseStore
from pipeserve.request import PromptInput, Requested


# Nesting a background request's body may have: its record on disk holds it one level down, and
# orjson writes 254 levels at most (the reader takes 1024)
BACKGROUND_DEPTH = 253


@dataclass
class Parsed:
    inputs: PromptInput
    requested: Requested
    conversation: list[dict[str, Any]]   # template messages without the instructions
    echo: dict[str, Any] = field(default_factory=dict)   # request fields the body repeats
    stream: bool = False
    store: bool = True
    constraint: Constraint | None = None   # text.format / guided_* (structured output)
    tools: ResponseTools = field(default_factory=ResponseTools)
    background: bool = False


def parse(body: dict[str, Any], store: ResponseStore | Looked, strict: bool = False) -> Parsed:
    previous = F.get(body, "previous_response_id", str)
    conversation = history(store, previous) + input_messages(body.get("input"))
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
    requested = replace(sampling_fields(body), max_tokens=F.get(body, "max_output_tokens", int))
    parallel = F.get(body, "parallel_tool_calls", bool, True)
    echo = {"instructions": instructions, "parallel_tool_calls": parallel,
            "truncation": _truncation(body), "max_output_tokens": requested.max_tokens,
            "previous_response_id": previous, "tool_choice": _choice_echo(body.get("tool_choice")),
            "tools": served.echo,
            "metadata": F.check_depth(F.get(body, "metadata", dict) or {}, "metadata", "metadata"),
            "reasoning": {"effort": effort, "summary": _summary(reasoning)},
            "text": {"format": fmt}}
    user = F.get(body, "user", str)
    if user is not None:   # OpenAI's Response omits `user` when none was given
        echo["user"] = user
    echo["background"] = F.get(body, "background", bool, False)
    if echo["background"]:   # kept on disk as sent, one level down in its record
        F.check_depth(body, "a background request's body (kept on disk as sent, so a restart "
                      "resumes it)", "background", BACKGROUND_DEPTH)
    cache_echo, pins = cache_key.pin(body, messages)   # the session's history kept in cache
    echo.update(cache_echo)
    inputs = PromptInput(messages=messages, tools=tools or None, template_kwargs=kwargs,
                         tool_choice=choice, tool_name=name, media=conversation_media(messages),
                         parallel_tool_calls=parallel, reasoning_budget=F.reasoning_budget(body),
                         cache_breakpoints=pins)
    return Parsed(inputs, requested, conversation, echo, F.get(body, "stream", bool, False),
                  F.get(body, "store", bool, True), constraint, served, echo["background"])


def _choice_echo(value: Any) -> Any:
    """tool_choice as the response repeats it: a named choice with its type and name only."""
    if isinstance(value, dict):
        return {"type": value["type"], "name": value["name"]}
    return value or "auto"


def _truncation(body: dict[str, Any]) -> str:
    truncation = F.get(body, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise InvalidRequest(f"truncation is {F.short(truncation)}; allowed: auto, disabled",
                             param="truncation")
    return truncation


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



