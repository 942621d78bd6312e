"""The families added beside Hermes/Qwen/Llama/Gemma: gpt-oss harmony, Mistral (v3, v11+), GLM,
DeepSeek (V3/R1, V3.1), Kimi-K2, MiniMax-M2, pythonic (Llama 4), MiniCPM5, Kimi-K3, LongCat,
Muse Spark, MiniMax-M3 and Step-3. Scripted model outputs of
real calls, cut at every position, parse to the same calls and content as the whole text;
malformed calls stay content; no marker ever reaches streamed content. No model."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from pipeserve.http.api.generation import Delta, OutputChain
from pipeserve.http.api.harmony import HarmonySplitter
from pipeserve.http.api.reasoning import ReasoningSplitter
from pipeserve.http.api.tools import ToolCallParser
from pipeserve.markup.output import ThinkMarkers
from pipeserve.markup.tool_formats import FORMATS
from pipeserve.markup.tool_formats.deepseek import BEGIN, CALL, CALL_END, END, SEP

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "hourly": {"type": "boolean"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                     "properties": {}}}},
]
Calls = list[tuple[str, dict[str, Any]]]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
NOW = ("now", {})
H = "<|channel|>commentary to=functions."
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CEND = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
O, S, C = "<|open|>", "<|sep|>", "<|close|>"   # Kimi-K3's XTML tokens
LC_K, LC_KE = "<longcat_arg_key>", "</longcat_arg_key>"
LC_V, LC_VE = "<longcat_arg_value>", "</longcat_arg_value>"
NS = "]<]minimax[>["   # MiniMax-M3's namespace marker on every tag
ST_B, ST_E = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"   # Step-3's markers
ST_C, ST_S, ST_CE = "<｜tool_call_begin｜>", "<｜tool_sep｜>", "<｜tool_call_end｜>"


def splits(text: str) -> list[list[str]]:
    return [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]


def chain(fmt: str) -> OutputChain:
    splitter = HarmonySplitter() if fmt == "harmony" else ReasoningSplitter(
        ThinkMarkers("<think>", "</think>"))
    return OutputChain(splitter, ToolCallParser(FORMATS[fmt], TOOLS, "test"))


def run(fmt: str, chunks: list[str]) -> tuple[Delta, list[Delta]]:
    c, pieces = chain(fmt), []
    for chunk in chunks:
        pieces.append(c.feed(chunk))
    pieces.append(c.finish())
    out = Delta()
    for d in pieces:
        out.extend(d)
    assert [t.index for t in out.tool_calls] == list(range(len(out.tool_calls)))
    return out, pieces


# (format, model output, reasoning, content, calls)
CASES: list[tuple[str, str, str, str, Calls]] = [
    ("harmony", "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
                f'{H}get_weather <|constrain|>json<|message|>{{"city": "Paris", "days": 3}}',
     "The user wants weather.", "", [PARIS]),
    ("harmony", '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}',
     "", "", [NOW]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                "<|message|>It is sunny in Paris.", "Easy.", "It is sunny in Paris.", []),
    ("harmony", "<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant"
                f"{H}now <|constrain|>json<|message|>{{}}", "", "Checking now.", [NOW]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "", "", [PARIS]),
    ("mistral", 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now'
                "[ARGS]{}", "", "On it.", [PARIS, NOW]),
    ("mistral", '[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}', "", "", [NOW]),
    ("mistral_v3", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                   '"days": 3}}, {"name": "now", "arguments": {}}]', "", "", [PARIS, NOW]),
    ("glm", "<think>Look it up.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
            "</tool_call>", "Look it up.", "", [PARIS]),
    ("glm", "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>now"
            "</tool_call>", "", "Sure.", [PARIS, NOW]),
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            '<arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value></tool_call>', "", "",
     [("get_weather", {"city": "Paris", "tags": ["a", "b"]})]),
    ("deepseek_v31", f'Let me check.{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 3}}'
                     f"{CALL_END}{CALL}now{SEP}{{}}{CALL_END}{END}", "", "Let me check.",
     [PARIS, NOW]),
    ("deepseek_v3", f'<think>Weather.</think>{BEGIN}{CALL}function{SEP}get_weather\n```json\n'
                    f'{{"city": "Paris", "days": 3}}\n```{CALL_END}{END}', "Weather.", "", [PARIS]),
    ("kimi_k2", f'{K_BEGIN}{K_CALL}functions.get_weather:0{K_ARGS}{{"city": "Paris", "days": 3}}'
                f"{K_CEND}{K_CALL}functions.now:1{K_ARGS}{{}}{K_CEND}{K_END}", "", "", [PARIS, NOW]),
    ("minimax_m2", '<think>Need it.</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name='
                   '"get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name='
                   '"days">3</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n'
                   "</minimax:tool_call>", "Need it.", "Checking.", [PARIS, NOW]),
    ("pythonic", '[get_weather(city="Paris", days=3), now()]', "", "", [PARIS, NOW]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3, hourly=true)]'
                 "<|python_end|>", "", "",
     [("get_weather", {"city": "Paris", "days": 3, "hourly": True})]),
    ("pythonic", "[1] is a citation, not a call.", "", "[1] is a citation, not a call.", []),
    ("minicpm5", 'Checking.<function name="get_weather"><param name="city">Paris</param>'
                 '<param name="days">3</param></function>\n<function name="now"></function>',
     "", "Checking.", [PARIS, NOW]),
    ("minicpm5", '<function name="get_weather"><param name="city"><![CDATA[Paris <north>\n'
                 '& co]]></param><param name="tags">["a", "b"]</param></function>', "", "",
     [("get_weather", {"city": "Paris <north>\n& co", "tags": ["a", "b"]})]),
    ("kimi_k3", f'{O}tools{S}{O}call tool="get_weather" index="1"{S}{O}argument key="city" '
                f'type="string"{S}Paris{C}argument{S}{O}argument key="days" type="integer"{S}3'
                f'{C}argument{S}{C}call{S}{O}call tool="now" index="2"{S}{C}call{S}{C}tools{S}',
     "", "", [PARIS, NOW]),
    ("kimi_k3", f'<think>Look.</think>On it.{O}tools{S}\n{O}call tool="get_weather" index="1"'
                f'{S}{O}json type="object"{S}{{"city": "Paris", "days": 3}}{C}json{S}{C}call{S}'
                f"\n{C}tools{S}", "Look.", "On it.", [PARIS]),
    ("longcat", f"<longcat_tool_call>get_weather\n{LC_K}city{LC_KE}\n{LC_V}Paris{LC_VE}\n"
                f"{LC_K}days{LC_KE}\n{LC_V}3{LC_VE}\n</longcat_tool_call>"
                "<longcat_tool_call>now</longcat_tool_call>", "", "", [PARIS, NOW]),
    ("longcat", 'Sure.<longcat_tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}</longcat_tool_call>', "", "Sure.", [PARIS]),
    ("muse_spark", '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter '
                   'name="city">Paris</atem:parameter>\n<atem:parameter name="days">3'
                   '</atem:parameter>\n</atem:invoke>\n<atem:invoke name="now">\n</atem:invoke>'
                   "\n</atem:function_calls>", "", "", [PARIS, NOW]),
    ("muse_spark", 'Let me look.<atem:function_calls><atem:invoke name="get_weather"><atem:parameter'
                   ' name="city" string="true">"Paris"</atem:parameter><atem:parameter name='
                   '"hourly">true</atem:parameter></atem:invoke></atem:function_calls>', "",
     "Let me look.", [("get_weather", {"city": "Paris", "hourly": True})]),
    ("minimax_m3", f'<think>Hm.</think>On it.{NS}<tool_call>\n{NS}<invoke name="get_weather">'
                   f"{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>\n"
                   f'{NS}<invoke name="now">{NS}</invoke>\n{NS}</tool_call>', "Hm.", "On it.",
     [PARIS, NOW]),
    ("minimax_m3", f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>'
                   f"{NS}<tags>{NS}<item>a{NS}</item>{NS}<item>b{NS}</item>{NS}</tags>"
                   f"{NS}<hourly>true{NS}</hourly>{NS}</invoke>{NS}</tool_call>", "", "",
     [("get_weather", {"city": "Paris", "tags": ["a", "b"], "hourly": True})]),
    ("step3", f'Let me check.\n{ST_B}\n{ST_C}function{ST_S}<steptml:invoke name="get_weather">'
              '\n<steptml:parameter name="city">Paris</steptml:parameter>\n<steptml:parameter '
              f'name="days">3</steptml:parameter>\n</steptml:invoke>{ST_CE}\n{ST_C}function'
              f'{ST_S}<steptml:invoke name="now"></steptml:invoke>{ST_CE}\n{ST_E}', "",
     "Let me check.", [PARIS, NOW]),
]


@pytest.mark.parametrize("fmt, text, reasoning, content, calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_family_outputs_parse_identically_at_every_chunk_boundary(
        fmt: str, text: str, reasoning: str, content: str, calls: Calls) -> None:
    f = FORMATS[fmt]
    markers = set(f.markers) | set(f.inner) | {"<think>", "</think>"}
    for chunks in splits(text):
        out, pieces = run(fmt, chunks)
        got = (out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls])
        assert got == (reasoning, content, calls), chunks
        if calls:   # no marker, and no part of one, is ever streamed as content
            for d in pieces:
                assert not any(m in d.content for m in markers), (chunks, d.content)
                assert "<|" not in d.content and "[TOOL" not in d.content


@pytest.mark.parametrize("fmt, text, reason", [
    ("harmony", f"{H}get_weather <|constrain|>json<|message|>{{\"city\": \"Par", "not JSON"),
    ("harmony", "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}",
     "not to a function tool"),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "not JSON"),
    ("mistral", "[TOOL_CALLS]just words", "expected name[ARGS]"),
    ("mistral_v3", '[TOOL_CALLS] [{"name": "get_weather"', "malformed"),
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>", "expected <arg_key>"),
    ("glm", "<tool_call>get_weather<arg_key>days</arg_key><arg_value>two</arg_value></tool_call>",
     "'days'"),
    ("deepseek_v31", f"{BEGIN}{CALL}get_weather{{\"city\": \"X\"}}{CALL_END}{END}", "tool▁sep"),
    ("deepseek_v31", f"{BEGIN}stray{CALL}now{SEP}{{}}{CALL_END}{END}", "outside"),
    ("kimi_k2", f"{K_BEGIN}{K_CALL}functions.now:0{K_ARGS}{{oops{K_CEND}{K_END}", "not JSON"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="now">\nhello\n</invoke>\n'
                   "</minimax:tool_call>", "outside <parameter"),
    ("pythonic", "[get_weather(city=Paris)]", "not a literal"),
    ("pythonic", "[launch(x=1)]", "launch"),
    ("minicpm5", '<function name="get_weather">Paris</function>', "expected <param name="),
    ("minicpm5", '<function name="get_weather"><param name="days">two</param></function>',
     "'days'"),
    ("kimi_k3", f'{O}tools{S}{O}call tool="now" index="1"{S}{O}json type="object"{S}{{oops'
                f"{C}json{S}{C}call{S}{C}tools{S}", "not JSON"),
    ("kimi_k3", f'{O}tools{S}{O}call index="1"{S}{C}call{S}{C}tools{S}', "tool="),
    ("kimi_k3", f'{O}tools{S}stray{O}call tool="now" index="1"{S}{C}call{S}{C}tools{S}',
     "outside"),
    ("longcat", f"<longcat_tool_call>get_weather{LC_K}city{LC_KE}Paris</longcat_tool_call>",
     "expected <longcat_arg_key>"),
    ("longcat", '<longcat_tool_call>{"name": "now", "arguments": </longcat_tool_call>',
     "not JSON"),
    ("muse_spark", '<atem:function_calls><atem:invoke name="now">hello</atem:invoke>'
                   "</atem:function_calls>", "outside <atem:parameter"),
    ("muse_spark", '<atem:function_calls><atem:invoke name="launch"></atem:invoke>'
                   "</atem:function_calls>", "launch"),
    ("minimax_m3", f'{NS}<tool_call>{NS}<invoke name="now">hello{NS}</invoke>{NS}</tool_call>',
     "elements only"),
    ("minimax_m3", f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</invoke>'
                   f"{NS}</tool_call>", "closes no open"),
    ("step3", f'{ST_B}{ST_C}function{ST_S}<steptml:invoke name="now">hi</steptml:invoke>{ST_CE}'
              f"{ST_E}", "outside <steptml:parameter"),
    ("step3", f"{ST_B}stray{ST_C}function{ST_S}<steptml:invoke name=\"now\"></steptml:invoke>"
              f"{ST_CE}{ST_E}", "outside"),
])
def test_malformed_family_calls_stay_content(fmt: str, text: str, reason: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    for chunks in ([text], list(text)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipeserve.tools"):
            out, _ = run(fmt, chunks)
        assert out.tool_calls == []
        assert out.content.strip()
        assert reason in caplog.text and "kept as text" in caplog.text


def test_harmony_analysis_streams_as_reasoning_before_the_message_ends() -> None:
    s = HarmonySplitter()
    got = "".join(s.feed(c)[0] for c in "<|channel|>analysis<|message|>step one, step two")
    assert got == "step one, step two" and s.in_reasoning
    assert s.feed("<|end|>") == ("", "") and not s.in_reasoning
    assert s.feed("<|start|>assistant<|channel|>final<|message|>Done") == ("", "Done")


def test_harmony_text_without_headers_is_content() -> None:
    assert run("harmony", list("plain words"))[0].content == "plain words"


def test_parallel_calls_off_keeps_the_first_call_only(caplog: pytest.LogCaptureFixture) -> None:
    """parallel_tool_calls false in auto mode: a second call is dropped, and the log says so."""
    text = ('<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": '
            '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    for chunks in ([text], list(text)):
        caplog.clear()
        p = ToolCallParser(FORMATS["hermes"], TOOLS, "test", max_calls=1)
        with caplog.at_level(logging.INFO, logger="pipeserve.tools"):
            calls = [c for ch in chunks for c in p.feed(ch)[1]] + p.finish()[1]
        assert [(c.name, c.arguments) for c in calls] == [NOW]
        assert "get_weather dropped: parallel_tool_calls is false" in caplog.text

