"""Kimi-K3 (XTML): `<|open|>tools<|sep|>` holding calls `<|open|>call tool="NAME" index="1"<|sep|>
... <|close|>call<|sep|>`, each with its arguments one element per key (`<|open|>argument
key="k" type="string"<|sep|>v<|close|>argument<|sep|>`: a string as written, other types as
JSON) or as one JSON object block (`<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`),
closed by `<|close|>tools<|sep|>`. Pure Python."""
from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, calls_grammar,
                                                json_object, quoted)

OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
BEGIN, END = OPEN + "tools" + SEP, CLOSE + "tools" + SEP


def _element(tag: str) -> re.Pattern[str]:
    """`<|open|>TAG attrs<|sep|>body<|close|>TAG<|sep|>` → (attrs, body)."""
    o, s, c = map(re.escape, (OPEN, SEP, CLOSE))
    return re.compile(f"{o}{tag}((?:(?!{s}).)*){s}(.*?){c}{tag}{s}", re.DOTALL)


_CALL, _ARGUMENT, _JSON = _element("call"), _element("argument"), _element("json")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _typed(value: str, kind: str) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value   # the tool's schema decides whether the text will do


def _call(attrs: str, body: str) -> RawCall:
    name = _attrs(attrs).get("tool")
    if not name:
        raise ValueError(f"Kimi-K3 call without a tool=\"...\" attribute: {attrs!r:.60}")
    block = _JSON.fullmatch(body.strip())
    if block is not None:
        return name, json_object(block.group(2), f"the JSON arguments of {name!r}")
    if _ARGUMENT.sub("", body).strip():
        raise ValueError(f"call to {name!r} holds text outside <|open|>argument elements")
    args: dict[str, Any] = {}
    for arg_attrs, value in _ARGUMENT.findall(body):
        a = _attrs(arg_attrs)
        if "key" not in a:
            raise ValueError(f"an argument of {name!r} has no key=\"...\" attribute")
        args[a["key"]] = _typed(value, a.get("type", "string"))
    return name, args


def parse(body: str) -> list[RawCall]:
    if _CALL.sub("", body).strip():
        raise ValueError(f"text outside <|open|>call ... <|close|>call in the tools section: "
                         f"{body!r:.60}")
    calls = [_call(attrs, inner) for attrs, inner in _CALL.findall(body)]
    if not calls:
        raise ValueError("no <|open|>call inside the tools section")
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def tag(opener: str, text: str) -> str:
        return f"{lit(opener)} {quoted(text)} {lit(SEP)}"

    def one(name: str, args: str) -> str:
        head = f'{lit(OPEN)} {quoted(f"call tool={chr(34)}{name}{chr(34)} index={chr(34)}")} ' \
               f'/[1-9][0-9]{{0,2}}/ "\\"" {lit(SEP)}'
        return (f'{head} {tag(OPEN, "json type=" + chr(34) + "object" + chr(34))} {args} '
                f'{tag(CLOSE, "json")} {tag(CLOSE, "call")}')
    return calls_grammar(specs, single, one, head=tag(OPEN, "tools"), tail=tag(CLOSE, "tools"))


FORMAT = ToolFormat("kimi_k3", (BEGIN,), END, parse,
                    lambda n: BEGIN + OPEN + "call tool=" + ("" if n is None else
                                                             f'"{n}" index="1"{SEP}'),
                    inner=(OPEN, SEP, CLOSE), grammar=grammar)
