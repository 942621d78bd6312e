"""DeepSeek: V3.1 (and later) write `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>
{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3-0324 and R1 write `function<｜tool▁sep｜>name`
and the arguments in a ```json fence. One parser reads both. Pure Python."""
from __future__ import annotations

import re

from pipeserve.markup.tool_formats.base import Lit, RawCall, Spec, ToolFormat, calls_grammar, json_object, quoted

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```\s*\Z", re.DOTALL)


def parse(body: str) -> list[RawCall]:
    calls = []
    if _CALL.sub("", body).strip():
        raise ValueError(f"text outside {CALL}...{CALL_END} in the tool calls: {body!r:.60}")
    for inner in _CALL.findall(body):
        if SEP not in inner:
            raise ValueError(f"tool call without {SEP}: {inner!r:.60}")
        left, right = inner.split(SEP, 1)
        fence = _FENCE.match(right)
        if left.strip() == "function" and fence is not None:   # V3 / R1
            calls.append((fence.group(1), json_object(fence.group(2), "tool call arguments")))
        else:                                                  # V3.1
            calls.append((left.strip(), json_object(right, f"arguments of {left.strip()!r}")))
    if not calls:
        raise ValueError(f"no {CALL} inside the tool calls")
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        return f"{lit(CALL)} {quoted(name)} {lit(SEP)} {args} {lit(CALL_END)}"
    return calls_grammar(specs, single, one, head=lit(BEGIN), tail=lit(END))


def grammar_v3(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        fence = quoted(name + "\n```json\n")
        return f'{lit(CALL)} "function" {lit(SEP)} {fence} {args} "\\n```" {lit(CALL_END)}'
    return calls_grammar(specs, single, one, head=lit(BEGIN), tail=lit(END))


FORMAT = ToolFormat("deepseek_v31", (BEGIN,), END, parse,
                    lambda n: BEGIN + CALL + ("" if n is None else n + SEP),
                    inner=(CALL, CALL_END, SEP), grammar=grammar)
FORMAT_V3 = ToolFormat("deepseek_v3", (BEGIN,), END, parse,
                       lambda n: BEGIN + CALL + "function" + SEP + ("" if n is None else n + "\n```json\n"),
                       inner=(CALL, CALL_END, SEP), grammar=grammar_v3)
