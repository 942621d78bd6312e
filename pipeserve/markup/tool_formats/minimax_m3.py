"""MiniMax-M3: every tag of the call carries the namespace marker `]<]minimax[>[`:
`NS<tool_call>\nNS<invoke name="NAME">NS<k>vNS</k>NS</invoke>\nNS</tool_call>`, several invokes
per block. An argument is an element named after its key; a nested object is nested elements,
an array repeated `<item>` elements. A top-level value is text, typed by the tool's schema; a
nested scalar is JSON when it reads as JSON, else text. Pure Python."""
from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives,
                                                quoted, repeat, xml_params)

NS = "]<]minimax[>["
BEGIN, END = NS + "<tool_call>", NS + "</tool_call>"
_TAG = re.compile(re.escape(NS) + r'<(/?)([A-Za-z_][\w.:-]*)(?:\s+name="([^"]*)")?\s*>')
Node = tuple[str, list[Any], str]   # (tag, children, text)


def _tree(body: str) -> list[Node]:
    """The namespaced elements of `body` as nodes; text outside an element is refused."""
    root: Node = ("", [], "")
    stack: list[tuple[str, list[Any], list[str], str | None]] = [("", root[1], [], None)]
    pos = 0
    for m in _TAG.finditer(body):
        stack[-1][2].append(body[pos:m.start()])
        closing, tag, name = m.group(1), m.group(2), m.group(3)
        if not closing:
            stack.append((tag, [], [], name))
        else:
            if len(stack) == 1 or stack[-1][0] != tag:
                raise ValueError(f"</{tag}> closes no open <{tag}> in the tool call")
            open_tag, kids, texts, attr = stack.pop()
            stack[-1][1].append((open_tag if attr is None else f"{open_tag}={attr}", kids,
                                 "".join(texts)))
        pos = m.end()
    stack[-1][2].append(body[pos:])
    if len(stack) > 1:
        raise ValueError(f"<{stack[-1][0]}> is never closed in the tool call")
    if "".join(stack[0][2]).strip():
        raise ValueError(f"text outside {NS}<invoke ...> elements: {body!r:.60}")
    return stack[0][1]


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _value(node: Node, top: bool) -> Any:
    tag, kids, text = node
    if not kids:
        return text if top else _scalar(text.strip())
    if text.strip():
        raise ValueError(f"<{tag}> holds both text and elements")
    if all(k[0] == "item" for k in kids):
        return [_value(k, False) for k in kids]
    return {k[0]: _value(k, False) for k in kids}


def parse(body: str) -> list[RawCall]:
    calls = []
    for tag, kids, text in _tree(body):
        if not tag.startswith("invoke=") or text.strip():
            raise ValueError(f"expected {NS}<invoke name=...> elements only, found <{tag}>")
        calls.append((tag.split("=", 1)[1].strip(), {k[0]: _value(k, True) for k in kids}))
    if not calls:
        raise ValueError(f"no {NS}<invoke name=...> inside the tool call")
    return calls


def _tag(tag: str, lit: Lit) -> str:
    """`NS<tag>` for the grammar; the marker and a tag that is one added token are that token."""
    return f"{lit(NS)} {lit(tag)}"


def _params(specs: list[Spec], lit: Lit) -> str:
    """Rules `params{i}`: each declared property in order as `NS<key>value NS</key>`; a string
    is free text, anything else JSON under its schema (a nested value written as JSON text)."""
    return xml_params(specs, lit, lambda key: _tag(f"<{key}>", lit), NS,
                      after=lambda key: lit(f"</{key}>"))


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    heads = [lit(NS) + " " + quoted(f'<invoke name="{name}">') for name, _ in specs]
    calls = alternatives([f'{h} params{i} {_tag("</invoke>", lit)} "\\n"'
                          for i, h in enumerate(heads)])
    return (f'start: {_tag("<tool_call>", lit)} "\\n" {repeat("call", single)} '
            f'{_tag("</tool_call>", lit)}\n'
            f"call: {calls}\n{_params(specs, lit)}")


FORMAT = ToolFormat("minimax_m3", (BEGIN,), END, parse,
                    lambda n: BEGIN + "\n" + NS + "<invoke name="
                    + ("" if n is None else f'"{n}">'),
                    inner=(NS,), grammar=grammar)
