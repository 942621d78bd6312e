"""MiniCPM5: `<function name="NAME"><param name="k">value</param>...</function>` with no outer
wrapper; parallel calls are consecutive blocks, and a value holding `<`, `&` or a newline is
wrapped in `<![CDATA[...]]>`. Values are text, typed by the tool's schema. Pure Python."""
from __future__ import annotations

import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives,
                                                quoted, repeat, xml_params)

START, END = "<function name=", "</function>"
_WORD = r"""("[^"]*"|'[^']*'|[^\s"'<>]+)"""
_NAME = re.compile(r"\s*" + _WORD + r"\s*>")
_PARAM = re.compile(r"\s*<param\s+name\s*=\s*" + _WORD
                    + r"\s*>(\s*<!\[CDATA\[.*?\]\]>\s*|.*?)</param>\s*", re.DOTALL)
_CDATA = re.compile(r"\s*<!\[CDATA\[(.*?)\]\]>\s*", re.DOTALL)


def _unquote(word: str) -> str:
    return word[1:-1] if word[:1] in "\"'" else word


def _value(raw: str) -> str:
    cdata = _CDATA.fullmatch(raw)
    return cdata.group(1) if cdata else raw.strip()


def parse(body: str) -> list[RawCall]:
    """`"NAME"><param name="k">v</param>...` (the text after `<function name=`)."""
    m = _NAME.match(body)
    if m is None:
        raise ValueError(f"MiniCPM5 call does not start with a quoted function name: {body!r:.60}")
    name, pos = _unquote(m.group(1)), m.end()
    args: dict[str, Any] = {}
    while body[pos:].strip():
        p = _PARAM.match(body, pos)
        if p is None:
            raise ValueError(f"expected <param name=...>value</param> in the call to {name!r}, "
                             f"got {body[pos:]!r:.60}")
        args[_unquote(p.group(1))] = _value(p.group(2))
        pos = p.end()
    return [(name, args)]


def forced(name: str | None) -> str:
    return START + ("" if name is None else f'"{name}">')


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    params = xml_params(specs, lit, lambda k: quoted(f'<param name="{k}">'), "</param>")
    calls = alternatives([f'{quoted(f"<function name={chr(34)}{name}{chr(34)}>")} params{i} '
                          f"{quoted(END)}" for i, (name, _) in enumerate(specs)])
    return f"start: {repeat('call', single, quoted(chr(10)))}\ncall: {calls}\n{params}"


FORMAT = ToolFormat("minicpm5", (START,), END, parse, forced, grammar=grammar)
