"""Output items keep the order the model wrote them in non-streaming bodies, as the stream's
blocks and items do: text, then a call, then more text is three blocks in that order (no
model: a finished generation's parts, shaped by the Anthropic and Responses adapters)."""
from __future__ import annotations

from types import SimpleNamespace

from pipeserve.http.api import anthropic_shape
from pipeserve.http.api.generation import Delta, Generation, Usage
from pipeserve.http.api.responses_shape import ResponseShape
from pipeserve.http.api.tools import ToolCall
from pipeserve.request import Requested, SamplingParams

CALL = ToolCall(0, "now", {"tz": "UTC"})


def finished(parts: list[tuple[str, object]]) -> Generation:
    """A generation that recorded `parts` as the output path records deltas (text in two
    deltas each, so a run is kept whole across them)."""
    request = SimpleNamespace(pins=(), num_prompt_tokens=5, requested=Requested(),
                              sampling=SamplingParams())
    gen = Generation(None, request, None)
    for kind, part in parts:
        if kind == "call":
            gen._record(Delta(tool_calls=[part]))
            continue
        text = str(part)
        for piece in (text[:2], text[2:]):
            gen._record(Delta(content=piece) if kind == "text" else Delta(reasoning=piece))
    gen.usage, gen.finish_reason, gen.stop_sequence = Usage(5, 3), "stop", None
    assert gen.parts == parts
    return gen


def test_text_after_a_call_stays_after_it() -> None:
    gen = finished([("reasoning", "Think."), ("text", "Checking."), ("call", CALL),
                    ("text", "Done.")])
    body = anthropic_shape.message_body("msg_1", "m", gen)
    assert [(b["type"], b.get("text") or b.get("thinking") or b.get("name"))
            for b in body["content"]] == [("thinking", "Think."), ("text", "Checking."),
                                          ("tool_use", "now"), ("text", "Done.")]
    shape = ResponseShape("resp_1", "m", {}, SamplingParams(), True)
    items = shape.output(gen)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "message"]
    assert items[3]["content"][0]["text"] == "Done."


def test_nothing_said_is_one_empty_text() -> None:
    gen = finished([])
    assert anthropic_shape.message_body("msg_1", "m", gen)["content"] == [{"type": "text", "text": ""}]
    shape = ResponseShape("resp_1", "m", {}, SamplingParams(), True)
    assert [i["type"] for i in shape.output(gen)] == ["message"]
