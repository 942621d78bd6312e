"""Reasoning spans and the output chain without a model: <think> split at every character
boundary, prompts that open the span, reasoning followed by tool calls, effort values."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeserve.http.api.generation import Delta, OutputChain
from pipeserve.http.api.reasoning import ReasoningSplitter, thinking_from_effort
from pipeserve.http.api.tools import ToolCallParser
from pipeserve.errors import InvalidRequest
from pipeserve.markup.output import OutputMarkup, ThinkMarkers, infer_think
from pipeserve.markup.tool_formats import FORMATS

THINK = ThinkMarkers("<think>", "</think>")
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


def split(chunks: list[str], prefix: str = "") -> tuple[str, str]:
    s = ReasoningSplitter(THINK)
    if prefix:
        assert s.feed(prefix) == ("", "")
    parts = [s.feed(c) for c in chunks] + [s.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def splits(text: str) -> list[list[str]]:
    return [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nLet me think.\nTwo lines.\n</think>\n\nThe answer is 4.",
     "Let me think.\nTwo lines.", "The answer is 4."),
    ("\n<think>short</think>answer", "short", "answer"),
    ("<think>\n\n</think>\n\nOnly content.", "", "Only content."),
    ("<think>never closed, cut by max_tokens", "never closed, cut by max_tokens", ""),
    ("No reasoning here. <think>this is content</think>", "",
     "No reasoning here. <think>this is content</think>"),
    ("  leading spaces stay when there is no span\n", "",
     "  leading spaces stay when there is no span\n"),
    ("<thin", "", "<thin"),
    ("<think>a < b and </thinking> is not the end</think>ok", "a < b and </thinking> is not the end",
     "ok"),
])
def test_think_spans_split_identically_at_every_chunk_boundary(text: str, reasoning: str,
                                                               content: str) -> None:
    for chunks in splits(text):
        assert split(chunks) == (reasoning, content), chunks


def test_a_prompt_that_opened_the_span_leaves_only_the_end_marker() -> None:
    text = "I should add.\n</think>\n\n4"
    for chunks in splits(text):
        assert split(chunks, prefix="<think>\n") == ("I should add.", "4")


def test_reasoning_streams_before_the_span_ends() -> None:
    s = ReasoningSplitter(THINK)
    got = "".join(s.feed(c)[0] for c in "<think>step one, step two")
    assert got == "step one, step two"
    assert s.in_reasoning
    assert s.feed("</think>") == ("", "") and not s.in_reasoning


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>assistant\n<think>\n", "<think>\n"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ""),
    ("<|im_start|>assistant\n", ""),
    ("earlier <think>x</think> turn<|im_start|>assistant\n<think>", "<think>"),
])
def test_open_span_is_found_at_the_end_of_the_prompt(prompt: str, opened: str) -> None:
    assert OutputMarkup(think=THINK).open_span(prompt) == opened
    assert OutputMarkup().open_span(prompt) == ""


def test_markers_come_from_the_tokenizer_then_the_template() -> None:
    tok = SimpleNamespace(think_start="<think>", think_end="</think>", chat_template=None)
    assert infer_think(tok) == THINK
    tok = SimpleNamespace(think_start=None, think_end=None,
                          chat_template="{{ '<think>\\n' }}...{{ '</think>' }}")
    assert infer_think(tok) == THINK
    tok = SimpleNamespace(think_start=None, think_end=None, chat_template="{{ x }}")
    assert infer_think(tok) is None


def test_reasoning_effort_values() -> None:
    assert thinking_from_effort("none", "reasoning_effort") is False
    assert all(thinking_from_effort(e, "x") for e in ("minimal", "low", "medium", "high"))
    with pytest.raises(InvalidRequest, match="reasoning_effort is 'max'"):
        thinking_from_effort("max", "reasoning_effort")


def run_chain(chain: OutputChain, chunks: list[str]) -> Delta:
    out = Delta()
    for c in chunks:
        out.extend(chain.feed(c))
    return out.extend(chain.finish())


def test_chain_reasoning_then_a_tool_call() -> None:
    text = ('<think>Need the time.</think>\n\nChecking.\n<tool_call>\n{"name": "now", '
            '"arguments": {}}\n</tool_call>')
    for chunks in splits(text):
        chain = OutputChain(ReasoningSplitter(THINK), ToolCallParser(FORMATS["hermes"], TOOLS))
        d = run_chain(chain, chunks)
        assert (d.reasoning, d.content) == ("Need the time.", "Checking.")
        assert [c.name for c in d.tool_calls] == ["now"]


def test_chain_with_a_forced_call_prefix() -> None:
    prefix = FORMATS["hermes"].forced("now")
    chain = OutputChain(ReasoningSplitter(THINK), ToolCallParser(FORMATS["hermes"], TOOLS), prefix)
    d = run_chain(chain, list(' {}}\n</tool_call>'))
    assert d.content == "" and [(c.name, c.arguments) for c in d.tool_calls] == [("now", {})]


def test_chain_without_parsers_is_the_text() -> None:
    text = "<think>kept</think> <tool_call>{}</tool_call>"
    assert run_chain(OutputChain(None, None), list(text)).content == text


# a call written inside a think span the model never closes (Qwen3.5 does this)
UNCLOSED = {
    "hermes": '<think>\nThe user wants the time.\n<tool_call>\n{"name": "now", "arguments": {}}\n'
              '</tool_call>',
    "qwen3_coder": "<think>\nThe user wants the time.\n<tool_call>\n<function=now>\n</function>\n"
                   "</tool_call>",
}


@pytest.mark.parametrize("family", sorted(UNCLOSED))
def test_a_call_inside_an_unclosed_think_span_is_a_call(family: str) -> None:
    from pipeserve.request import PromptInput, Request
    markup = OutputMarkup(think=THINK, tool_format=FORMATS[family])
    request = Request(request_id="r", endpoint="chat",
                      inputs=PromptInput(messages=[], tools=TOOLS))
    for chunks in splits(UNCLOSED[family]):
        d = run_chain(OutputChain.for_request(request, markup), chunks)
        assert d.reasoning == "The user wants the time.", chunks
        assert d.content == "" and [c.name for c in d.tool_calls] == ["now"], chunks
    # the reasoning streams live up to the call; no markup reaches it
    chain = OutputChain.for_request(request, markup)
    streamed = [chain.feed(c).reasoning for c in UNCLOSED[family]]
    assert "".join(streamed) == "The user wants the time.\n"[:len("".join(streamed))]
    # without tools the span is reasoning to the end, as before
    plain = Request(request_id="r", endpoint="chat", inputs=PromptInput(messages=[]))
    d = run_chain(OutputChain.for_request(plain, markup), [UNCLOSED[family]])
    assert "<tool_call>" in d.reasoning and not d.tool_calls
