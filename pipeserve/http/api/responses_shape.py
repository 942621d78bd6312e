"""Response objects and the streaming event chain of OpenAI's Responses API (created,
in_progress, output_item / content_part / output_text / reasoning_text / function_call
events, completed | incomplete | failed), each with its sequence_number. Event loop."""
from __future__ import annotations

import time
import uuid
from typing import Any

from pipeserve.http.api.generation import Delta, Generation, Usage
from pipeserve.http.api.openai_shape import incomplete_fields, miss_fields
from pipeserve.http.api.responses_tools import custom_input
from pipeserve.http.api.tools import ToolCall
from pipeserve.errors import ServeError
from pipeserve.request import SamplingParams


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0,
                                 **miss_fields(usage)},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if usage.speculation is not None:
        out["speculation"] = usage.speculation
    if usage.record is not None:
        out["pipeserve"] = usage.record
    return {**out, **incomplete_fields(usage)}


def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": f"call_{call.id}",
            "name": call.name, "status": status,
            "arguments": call.arguments_json if arguments is None else arguments}


def custom_item(call: ToolCall, text: str | None = None) -> dict[str, Any]:
    """A custom (freeform) tool's call: its `input` is the text the call carries (the item has
    no status in OpenAI's schema)."""
    return {"type": "custom_tool_call", "id": f"ctc_{call.id}", "call_id": f"call_{call.id}",
            "name": call.name, "input": custom_input(call.arguments) if text is None else text}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseShape:
    """The response object of one request, in any state."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any],
                 sampling: SamplingParams, store: bool, custom: frozenset[str] = frozenset()) -> None:
        self.response_id, self.model, self.echo, self.store = response_id, model, echo, store
        self.sampling = sampling
        self.custom = custom   # the custom tools' names: their calls are custom_tool_call items
        self.created_at = int(time.time())

    def call(self, call: ToolCall, status: str = "completed", partial: bool = False) -> dict[str, Any]:
        """A call's output item (`partial`: as output_item.added opens it, empty)."""
        if call.name in self.custom:
            return custom_item(call, "" if partial else None)
        return call_item(call, status, "" if partial else None)

    def body(self, output: list[dict[str, Any]], gen: Generation | None,
             status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = gen is not None and gen.finish_reason == "length"
        status = status or ("incomplete" if incomplete else "completed")
        out = {"id": self.response_id, "object": "response", "created_at": self.created_at,
               "status": status, "model": self.model, "output": output,
               "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "parallel_tool_calls": True, "temperature": self.sampling.temperature,
               "top_p": self.sampling.top_p, "text": {"format": {"type": "text"}},
               "truncation": "disabled", "store": self.store, **self.echo}
        if gen is not None and status != "in_progress":   # the schema's usage is never null
            out["usage"] = usage_body(gen.usage)
        return out

    def output(self, gen: Generation, cut: bool = False) -> list[dict[str, Any]]:
        """All output items of a finished generation (reasoning, messages, calls) in order;
        `cut`: it was stopped before its end (a cancel), so its messages are incomplete."""
        status = "incomplete" if cut or gen.finish_reason == "length" else "completed"
        out = []
        for kind, part in gen.parts:   # in the order the model wrote them, as the stream's items
            if isinstance(part, ToolCall):
                out.append(self.call(part))
            elif kind == "reasoning":
                out.append(reasoning_item(_id("rs"), part, "completed"))
            else:
                out.append(message_item(_id("msg"), part, status))
        if not out:   # nothing said: one empty message, as the stream sends
            out.append(message_item(_id("msg"), "", status))
        return out


class ResponseEvents:
    """Deltas → the Responses event chain. One item is open at a time (a reasoning item or
    a message); a tool call closes it and is sent whole as a function_call item."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.items: list[dict[str, Any]] = []   # finished output items, in order
        self.open: str | None = None            # "reasoning" | "message"
        self.item_id = ""
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def begin(self) -> list[dict[str, Any]]:
        body = self.shape.body([], None, status="in_progress")
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            out += self._ensure("reasoning")
            out.append(self._event("response.reasoning_text.delta", **self._where(),
                                   delta=delta.reasoning))
            self.text += delta.reasoning
        if delta.content:
            out += self._ensure("message")
            out.append(self._event("response.output_text.delta", **self._where(),
                                   delta=delta.content, logprobs=[]))
            self.text += delta.content
        for call in delta.tool_calls:
            out += self.close("completed") + self._call(call)
        return out

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        """One whole call: item added, its arguments (a custom tool's input), item done."""
        index = len(self.items)
        item = self.shape.call(call)
        where = {"item_id": item["id"], "output_index": index}
        out = [self._event("response.output_item.added", output_index=index,
                           item=self.shape.call(call, "in_progress", partial=True))]
        if item["type"] == "custom_tool_call":
            out += [self._event("response.custom_tool_call_input.delta", **where,
                                delta=item["input"]),
                    self._event("response.custom_tool_call_input.done", **where,
                                input=item["input"])]
        else:
            out += [self._event("response.function_call_arguments.delta", **where,
                                delta=call.arguments_json),
                    self._event("response.function_call_arguments.done", **where,
                                arguments=call.arguments_json, name=call.name)]
        self.items.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        if self.open == kind:
            return []
        out = self.close("completed")
        self.open, self.item_id, self.text = kind, _id("rs" if kind == "reasoning" else "msg"), ""
        make = reasoning_item if kind == "reasoning" else message_item
        out.append(self._event("response.output_item.added", output_index=len(self.items),
                               item=make(self.item_id, None, "in_progress")))
        part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part(""))
        out.append(self._event("response.content_part.added", **self._where(), part=part))
        return out

    def close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        if self.open == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            done = self._event("response.reasoning_text.done", **self._where(), text=self.text)
            item = reasoning_item(self.item_id, self.text, "completed")
        else:
            part = _text_part(self.text)
            done = self._event("response.output_text.done", **self._where(), text=self.text,
                               logprobs=[])
            item = message_item(self.item_id, self.text, status)
        out = [done, self._event("response.content_part.done", **self._where(), part=part),
               self._event("response.output_item.done", output_index=len(self.items), item=item)]
        self.items.append(item)
        self.open = None
        return out

    def end(self, gen: Generation) -> list[dict[str, Any]]:
        """Close what is open (an empty message if nothing was said), then the final event,
        response.completed or response.incomplete, whose `response` is the body."""
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        out = self.close(status)
        if not self.items:
            out += self._ensure("message") + self.close(status)
        body = self.shape.body(self.items, gen)
        return out + [self._event(f"response.{body['status']}", response=body)]

    def fail(self, e: ServeError) -> list[dict[str, Any]]:
        error = {"code": "server_error", "message": e.message}
        body = self.shape.body(self.items, None, status="failed", error=error)
        return [self._event("error", code=e.code or e.error_type, message=e.message,
                            param=e.param),
                self._event("response.failed", response=body)]
