"""Protocol shapes without a model: Anthropic content-block events and the Responses event
chain built from synthetic output, checked against the official SDKs' typed models."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anthropic.types as at
import openai.types.responses as rt
import pytest
from pydantic import TypeAdapter

from pipeserve.http.api.anthropic_shape import BlockStream, message_body
from pipeserve.http.api.generation import Delta, Usage
from pipeserve.http.api.responses_shape import ResponseEvents, ResponseShape
from pipeserve.http.api.tools import ToolCall
from pipeserve.errors import StageError
from pipeserve.request import SamplingParams

CALL = ToolCall(0, "get_weather", {"city": "Paris"}, id="abc")
DELTAS = [Delta(reasoning="thinking "), Delta(reasoning="more"), Delta(content="Let me "),
          Delta(content="check."), Delta(tool_calls=[CALL]), Delta(content="Done.")]


def fake_gen(finish: str = "tool_calls") -> Any:
    return SimpleNamespace(finish_reason=finish, stop_sequence=None, reasoning="thinking more",
                           request=SimpleNamespace(pins=()),   # no cache_control breakpoints
                           content="Let me check.Done.", tool_calls=[CALL],
                           parts=[("reasoning", "thinking more"), ("text", "Let me check.Done."),
                                  ("call", CALL)],   # in the order the model wrote them
                           usage=Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=4,
                                       reasoning_tokens=2))


def test_anthropic_blocks_open_and_close_as_the_output_kind_changes() -> None:
    blocks = BlockStream()
    events = [e for d in DELTAS for e in blocks.events(d)] + blocks.close(ensure_one=True)
    adapter = TypeAdapter(at.RawMessageStreamEvent)
    for _, body in events:
        adapter.validate_python(body)
    names = [(n, b.get("index"), (b.get("content_block") or b.get("delta") or {}).get("type"))
             for n, b in events]
    assert names == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"),
        ("content_block_stop", 3, None)]
    assert events[9][1]["delta"]["partial_json"] == '{"city": "Paris"}'


def test_anthropic_message_body_validates() -> None:
    body = message_body("msg_1", "tiny", fake_gen())
    msg = at.Message.model_validate(body)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.stop_reason == "tool_use" and msg.usage.cache_read_input_tokens == 4
    assert msg.content[2].id == "toolu_abc" and msg.content[2].input == {"city": "Paris"}


@pytest.mark.parametrize("finish, final", [("tool_calls", "response.completed"),
                                           ("length", "response.incomplete")])
def test_responses_event_chain(finish: str, final: str) -> None:
    shape = ResponseShape("resp_1", "tiny", {"tools": [], "tool_choice": "auto"},
                          SamplingParams(), True)
    events_ = ResponseEvents(shape)
    events = events_.begin() + [e for d in DELTAS for e in events_.feed(d)] + events_.end(
        fake_gen(finish))
    adapter = TypeAdapter(rt.ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done", final.removeprefix("response.")]
    body = rt.Response.model_validate(events[-1]["response"])
    assert [o.type for o in body.output] == ["reasoning", "message", "function_call", "message"]
    assert body.output[2].call_id == "call_abc" and body.output[2].arguments == '{"city": "Paris"}'
    assert body.usage.input_tokens_details.cached_tokens == 4
    assert body.usage.output_tokens_details.reasoning_tokens == 2
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [
        0, 1, 2, 3]


def test_responses_failure_events() -> None:
    shape = ResponseShape("resp_1", "tiny", {"tools": [], "tool_choice": "auto"},
                          SamplingParams(), True)
    chain = ResponseEvents(shape)
    events = chain.begin() + chain.fail(StageError("sample", ["resp_1"], RuntimeError("boom")))
    adapter = TypeAdapter(rt.ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
