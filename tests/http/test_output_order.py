"""Output items keep the order the model wrote them in non-streaming bodies, as the stream's
blocks and items do: text, then a call, then more text is three blocks in that order (no
model: a finished generation's parts, shaped by the Anthropic and Responses adapters)."""
from __future__ import annotations

from types import SimpleNamespace

from pipeserve.http.api import anthropic
from pipeserve.http.api.generation import Generation, Usage
from pipeserve.http.api.responses_shape import ResponseShape
from pipeserve.http.api.tools import ToolCall
from pipeserve.request import SamplingParams

CALL = ToolCall(0, "now", {"tz": "UTC"})


def finished(parts: list[tuple[str, object]]) -> Generation:
    gen = Generation.__new__(Generation)
    gen.parts, gen.usage, gen.finish_reason, gen.stop_sequence = parts, Usage(5, 3), "stop", None
    gen.request = SimpleNamespace(pins=())
    return gen


def test_text_after_a_call_stays_after_it() -> None:
    gen = finished([("reasoning", "Think."), ("text", "Checking."), ("call", CALL),
                    ("text", "Done.")])
    body = anthropic.message_body("msg_1", "m", gen)
    assert [(b["type"], b.get("text") or b.get("thinking") or b.get("name"))
            for b in body["content"]] == [("thinking", "Think."), ("text", "Checking."),
                                          ("tool_use", "now"), ("text", "Done.")]
    shape = ResponseShape("resp_1", "m", {}, SamplingParams(), True)
    items = shape.output(gen)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "message"]
    assert items[3]["content"][0]["text"] == "Done."


def test_nothing_said_is_one_empty_text() -> None:
    gen = finished([])
    assert anthropic.message_body("msg_1", "m", gen)["content"] == [{"type": "text", "text": ""}]
    shape = ResponseShape("resp_1", "m", {}, SamplingParams(), True)
    assert [i["type"] for i in shape.output(gen)] == ["message"]
