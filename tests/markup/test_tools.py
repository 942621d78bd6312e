"""Tool-call parsing without a model: every family's markup on recorded strings, split at
every character boundary, malformed markup kept as text, schema coercion, format inference."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from pipeserve.http.api.tools import ToolCallParser, decode_arguments
from pipeserve.markup.output import infer_tool_format
from pipeserve.model.tiny.text import CHAT_TEMPLATE
from pipeserve.markup.tool_formats import FORMATS

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"},
            "ratio": {"type": "number"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                     "properties": {}}}},
]
Calls = list[tuple[str, dict[str, Any]]]


def parse(fmt: str, chunks: list[str]) -> tuple[str, Calls, list[str]]:
    """Feed chunks; returns (content, calls, content pieces as released)."""
    p = ToolCallParser(FORMATS[fmt], TOOLS, "test")
    pieces, calls = [], []
    for chunk in chunks:
        text, new = p.feed(chunk)
        pieces.append(text)
        calls += new
    text, new = p.finish()
    pieces.append(text)
    calls += new
    assert [c.index for c in p.calls] == list(range(len(p.calls)))
    return "".join(pieces), [(c.name, c.arguments) for c in calls], pieces


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every position."""
    return [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]


# (format, model output, expected content, expected calls)
CASES: list[tuple[str, str, str, Calls]] = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("hermes", 'Before <tool_call>{"name": "now", "arguments": "{}"}</tool_call> after.',
     "Before after.", [("now", {})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',   # unterminated
     "", [("get_weather", {"city": "Oslo"})]),
    ("hermes", "Plain text with a < sign, <b>tags</b> and <tool_ but no call.",
     "Plain text with a < sign, <b>tags</b> and <tool_ but no call.", []),
    ("qwen3_coder", "I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>"
                    "\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n"
                    "</tool_call>",
     "I will call it.", [("get_weather", {"city": "New York", "days": 3, "hourly": True,
                                           "ratio": 0.5})]),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</tool_call>", "", [("now", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "Rome", "tags": ["a", "b"]})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [("get_weather", {"city": "Paris"})]),
    ("llama3", ' {"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": '
               '{"city": "Lima", "days": "2"}}',
     "", [("now", {}), ("get_weather", {"city": "Lima", "days": 2})]),
    ("llama3", 'Sure.<|python_tag|>{"name": "now", "parameters": {}}', "Sure.", [("now", {})]),
    ("llama3", "No call {here} at all.", "No call {here} at all.", []),
    ("gemma", 'Checking.\n```tool_code\nprint(get_weather(city="Paris", days=2))\n```\n',
     "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("gemma", "```tool_code\nnow()\nget_weather(city='Bern', hourly=true)\n```",
     "", [("now", {}), ("get_weather", {"city": "Bern", "hourly": True})]),
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Paris, {France}"
                       "<escape>,days:4}<end_function_call>",
     "", [("get_weather", {"city": "Paris, {France}", "days": 4})]),
    ("gemma4", 'Ok <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,tags:[<|"|>x<|"|>,2]}'
               "<tool_call|>",
     "Ok", [("get_weather", {"city": "Oslo", "tags": ["x", 2]})]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_calls_parse_identically_at_every_chunk_boundary(fmt: str, text: str, content: str,
                                                         calls: Calls) -> None:
    for chunks in splits(text):
        got_content, got_calls, pieces = parse(fmt, chunks)
        assert (got_content, got_calls) == (content, calls), chunks
        if calls:   # the markup never leaks into streamed content
            for marker in FORMATS[fmt].markers:
                assert all(marker not in p for p in pieces)


def test_text_before_a_call_streams_before_the_call_ends() -> None:
    text = 'Let me look that up for you. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    p = ToolCallParser(FORMATS["hermes"], TOOLS)
    released = ""
    for ch in text[:text.index("</tool_call>")]:
        released += p.feed(ch)[0]
    assert released == "Let me look that up for you."
    assert p.feed("</tool_call>")[1][0].name == "now"


@pytest.mark.parametrize("fmt, text, reason", [
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "not JSON"),
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', "launch_rockets"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>', "city"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "X", "days": "two"}}'
               "</tool_call>", "days"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "X", "unit": "k"}}'
               "</tool_call>", "unit"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', "not an object"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
                    "<parameter=days>\n3.5\n</parameter>\n</function>\n</tool_call>", "days"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</tool_call>",
     "unterminated"),
    ("qwen3_coder", "<tool_call>\njust words\n</tool_call>", "<function"),
    ("llama3", '{"name": "now", "parameters": {}} trailing words', "malformed"),
    ("gemma", "```tool_code\nimport os\n```", "tool_code"),
    ("function_gemma", "<start_function_call>call:now{oops<end_function_call>", "':'"),
])
def test_malformed_calls_stay_text_with_a_logged_reason(fmt: str, text: str, reason: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    for chunks in ([text], list(text)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipeserve.tools"):
            content, calls, _ = parse(fmt, chunks)
        assert calls == []
        assert content == text.strip()
        assert reason in caplog.text and "kept as text" in caplog.text


def test_a_good_call_after_a_bad_one_still_parses() -> None:
    text = ('<tool_call>oops</tool_call> then <tool_call>{"name": "now", "arguments": {}}'
            "</tool_call>")
    for chunks in splits(text):
        content, calls, _ = parse("hermes", chunks)
        assert content == "<tool_call>oops</tool_call> then"
        assert calls == [("now", {})]


def test_whitespace_is_kept_exactly_when_there_is_no_call() -> None:
    text = "  two leading spaces,\n\na blank line and a trailing newline\n"
    for fmt in FORMATS:
        for chunks in ([text], list(text)):
            assert parse(fmt, chunks)[0] == text, fmt


@pytest.mark.parametrize("prop, raw, want", [
    ({"type": "integer"}, "3", 3), ({"type": "integer"}, "3.0", 3), ({"type": "integer"}, 4.0, 4),
    ({"type": "number"}, "2.5", 2.5), ({"type": "number"}, "-7", -7),
    ({"type": "boolean"}, "False", False), ({"type": "null"}, "null", None),
    ({"type": "object"}, '{"a": 1}', {"a": 1}), ({"type": "array"}, "[1]", [1]),
    ({"type": "string"}, 12, "12"), ({"type": ["integer", "string"]}, "12", 12),
    ({"type": ["integer", "string"]}, "twelve", "twelve"), ({"type": ["null", "integer"]}, "null", None),
    ({}, "anything", "anything"), ({"enum": ["a", "b"]}, "b", "b"),
])
def test_arguments_are_decoded_against_the_schema(prop: dict[str, Any], raw: Any, want: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": prop}}}}]
    assert decode_arguments(("f", {"x": raw}), tools) == ("f", {"x": want})


@pytest.mark.parametrize("prop, raw", [
    ({"type": "integer"}, "3.5"), ({"type": "integer"}, True), ({"type": "boolean"}, "yes"),
    ({"type": "number"}, "fast"), ({"type": "object"}, "[1]"), ({"enum": ["a"]}, "z"),
])
def test_arguments_that_do_not_fit_the_schema_are_refused(prop: dict[str, Any], raw: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": prop}}}}]
    with pytest.raises(ValueError, match="'x'"):
        decode_arguments(("f", {"x": raw}), tools)


@pytest.mark.parametrize("template, want", [
    (CHAT_TEMPLATE, "hermes"),
    ("{{ '<tool_call>\\n<function=' + name + '>' }}", "qwen3_coder"),
    ("{{ '<|tool_call>call:' }}{{ '<tool_call|>' }}", "gemma4"),
    ("{{ '<start_function_call>' }}", "function_gemma"),
    ("{%- if builtin_tools %}{{ '<|python_tag|>' }}{% endif %}", "llama3"),
    ("```tool_code\n", "gemma"),
    ("{{ '<|start|>assistant to=functions.' }}<|channel|>commentary<|message|>", "harmony"),
    ("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral"),
    ("{{ '[TOOL_CALLS] [' }}", "mistral_v3"),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", "glm"),
    ("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args", "deepseek_v31"),
    ("'<｜tool▁sep｜>' + name + '\\n```json\\n'", "deepseek_v3"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2"),
    ("<minimax:tool_call><invoke name=", "minimax_m2"),
    ("{{ '<|python_start|>' }}[func(a=1)]", "pythonic"),
    ("{{ '<function name=\"' ~ name ~ '\"><param name=\"' }}", "minicpm5"),
    ("{{ '<longcat_tool_call>' }}{{ '<longcat_arg_key>' }}", "longcat"),
    ("{{ '<atem:function_calls>' }}", "muse_spark"),
    ("{{ ']<]minimax[>[' ~ '<tool_call>' }}", "minimax_m3"),
    ("{{ '<｜tool_calls_begin｜>' }}<steptml:invoke name=", "step3"),
    ("{{ messages[0].content }}", None),
])
def test_format_is_inferred_from_the_chat_template(template: str, want: str | None) -> None:
    assert infer_tool_format(template, {}) == want


def test_kimi_k3_is_inferred_from_its_vocabulary() -> None:
    """Its templates assemble the XTML markers from parts; mlx-lm falls back to the tokens."""
    xtml = {t: i for i, t in enumerate(("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))}
    assert infer_tool_format("{{ open ~ 'tools' ~ sep }}", xtml) == "kimi_k3"
    assert infer_tool_format("{{ open ~ 'tools' ~ sep }}", {"<|open|>": 0}) is None


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_prefix_opens_a_call_the_parser_then_closes(fmt: str) -> None:
    """tool_choice named: the prompt ends with the call's opening markup and the tool name;
    fed as the parser's starting state, the model's remaining text completes the call."""
    f = FORMATS[fmt]
    rest = {"hermes": ' {"city": "Paris"}}\n</tool_call>',
            "qwen3_coder": "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
            "llama3": ' {"city": "Paris"}}',
            "gemma": 'city="Paris")\n```',
            "function_gemma": "city:<escape>Paris<escape>}<end_function_call>",
            "gemma4": 'city:<|"|>Paris<|"|>}<tool_call|>',
            "harmony": '{"city": "Paris"}',
            "mistral": '{"city": "Paris"}',
            "mistral_v3": '{"city": "Paris"}}]',
            "glm": "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
            "deepseek_v31": '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "deepseek_v3": '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "kimi_k2": '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
            "minimax_m2": '<parameter name="city">Paris</parameter>\n</invoke>\n'
                          "</minimax:tool_call>",
            "pythonic": 'city="Paris")]',
            "minicpm5": '<param name="city">Paris</param></function>',
            "kimi_k3": '<|open|>json type="object"<|sep|>{"city": "Paris"}<|close|>json<|sep|>'
                       "<|close|>call<|sep|><|close|>tools<|sep|>",
            "longcat": "<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Paris"
                       "</longcat_arg_value>\n</longcat_tool_call>",
            "muse_spark": '<atem:parameter name="city">Paris</atem:parameter>\n</atem:invoke>\n'
                          "</atem:function_calls>",
            "minimax_m3": "]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>\n"
                          "]<]minimax[>[</tool_call>",
            "step3": '<steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke>'
                     "<｜tool_call_end｜><｜tool_calls_end｜>"}[fmt]
    p = ToolCallParser(f, TOOLS)
    assert p.feed(f.forced("get_weather")) == ("", [])
    text, calls = p.feed(rest)
    tail, more = p.finish()
    assert text + tail == ""
    assert [(c.name, c.arguments) for c in calls + more] == [("get_weather", {"city": "Paris"})]
    assert f.forced(None) and f.forced("get_weather").startswith(f.forced(None)[:3])
