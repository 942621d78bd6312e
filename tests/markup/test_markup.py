"""The output markup built at load: think markers and tool-call format from the tokenizer, the
chat template and model.tool_call_format; the markers decoding keeps."""
from __future__ import annotations

from types import SimpleNamespace

from pipeserve.markup.output import KNOWN_MARKERS, OutputMarkup, ThinkMarkers
from pipeserve.model.tiny.text import CHAT_TEMPLATE
from pipeserve.markup.tool_formats import FORMATS


def tokenizer(template: str | None, think: tuple[str, str] | None = None) -> SimpleNamespace:
    start, end = think or (None, None)
    return SimpleNamespace(chat_template=template, think_start=start, think_end=end,
                           get_vocab=dict)


def test_infer_reads_the_template_and_the_setting() -> None:
    tok = tokenizer(CHAT_TEMPLATE + "{{ '<think>' }}{{ '</think>' }}")
    markup = OutputMarkup.infer(tok)
    assert markup.tool_format is FORMATS["hermes"]
    assert markup.think == ThinkMarkers("<think>", "</think>")
    assert markup.describe() == "tool calls hermes, think markers <think>…</think>"
    assert OutputMarkup.infer(tok, "none").tool_format is None
    assert OutputMarkup.infer(tok, "gemma").tool_format is FORMATS["gemma"]
    assert OutputMarkup.infer(tokenizer("{{ x }}")) == OutputMarkup()


def test_the_tokenizer_markers_come_first() -> None:
    tok = tokenizer("{{ '<think>' }}{{ '</think>' }}", ("<|think:start|>", "<|think:end|>"))
    assert OutputMarkup.infer(tok).think == ThinkMarkers("<|think:start|>", "<|think:end|>")


def test_decoding_keeps_every_family_marker() -> None:
    assert OutputMarkup().kept == KNOWN_MARKERS
    assert {"<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>",
            "<|tool_call>", "<tool_call|>", "<start_function_call>"} <= KNOWN_MARKERS
