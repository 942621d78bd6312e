"""Muse Spark (XML_ATEM): `<atem:function_calls>\n<atem:invoke name="NAME">\n<atem:parameter
name="k">v</atem:parameter>\n</atem:invoke>\n</atem:function_calls>`, several invokes per block.
A value that is a JSON string is decoded; other values are text, typed by the tool's schema.
Pure Python."""
from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives,
                                                quoted, repeat, xml_params)

BEGIN, END = "<atem:function_calls>", "</atem:function_calls>"
_INVOKE = re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)"[^>]*>(.*?)</atem:invoke>', re.DOTALL)
_PARAM = re.compile(r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*>(.*?)</atem:parameter>',
                    re.DOTALL)


def _value(raw: str) -> Any:
    text = raw.strip()
    if text.startswith('"'):
        try:
            decoded = json.loads(text)
        except json.JSONDecodeError:
            return text
        return decoded if isinstance(decoded, str) else text
    return text


def parse(body: str) -> list[RawCall]:
    if _INVOKE.sub("", body).strip():
        raise ValueError(f"text outside <atem:invoke ...>...</atem:invoke> in the tool call: "
                         f"{body!r:.60}")
    calls = []
    for name, inner in _INVOKE.findall(body):
        if _PARAM.sub("", inner).strip():
            raise ValueError(f"invoke {name!r} holds text outside <atem:parameter ...> elements")
        calls.append((name.strip(), {k.strip(): _value(v) for k, v in _PARAM.findall(inner)}))
    if not calls:
        raise ValueError("no <atem:invoke name=...> inside the tool call")
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    params = xml_params(specs, lit, lambda k: quoted(f'<atem:parameter name="{k}">'),
                        "</atem:parameter>\n")
    heads = [quoted(f'<atem:invoke name="{name}">' + "\n") for name, _ in specs]
    calls = alternatives([f'{head} params{i} "</atem:invoke>\\n"' for i, head in enumerate(heads)])
    return (f'start: {lit(BEGIN)} "\\n" {repeat("call", single)} {lit(END)}\n'
            f"call: {calls}\n{params}")


FORMAT = ToolFormat("muse_spark", (BEGIN,), END, parse,
                    lambda n: BEGIN + "\n<atem:invoke name=" + ("" if n is None else f'"{n}">\n'),
                    grammar=grammar)
