"""Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`. Pure Python."""
from __future__ import annotations

import re

from pipeserve.markup.tool_formats.base import Lit, RawCall, Spec, ToolFormat, calls_grammar, json_object, quoted

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL = re.compile(re.escape(CALL) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_ID = re.compile(r"\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*" + re.escape(ARGS), re.DOTALL)


def parse(body: str) -> list[RawCall]:
    if _CALL.sub("", body).strip():
        raise ValueError(f"text outside {CALL}...{CALL_END} in the tool calls: {body!r:.60}")
    calls = []
    for inner in _CALL.findall(body):
        m = _ID.match(inner)
        if m is None:
            raise ValueError(f"expected functions.NAME:IDX{ARGS} in {inner!r:.60}")
        calls.append((m.group(1), json_object(inner[m.end():], f"arguments of {m.group(1)!r}")))
    if not calls:
        raise ValueError(f"no {CALL} inside the tool-calls section")
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        return f"{lit(CALL)} {quoted('functions.' + name + ':')} /[0-9]{{1,3}}/ {lit(ARGS)} {args} {lit(CALL_END)}"
    return calls_grammar(specs, single, one, head=lit(BEGIN), tail=lit(END))


FORMAT = ToolFormat("kimi_k2", (BEGIN,), END, parse,
                    lambda n: BEGIN + CALL + "functions." + ("" if n is None else n + ":0" + ARGS),
                    inner=(CALL, ARGS, CALL_END), grammar=grammar)
