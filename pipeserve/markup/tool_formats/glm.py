"""GLM-4.5 / 4.6 / 4.7: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...
</tool_call>` (4.5 and 4.6 put a newline after the name and each element; 4.7 none). Values
are text, typed by the tool's schema. Pure Python."""
from __future__ import annotations

import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives, quoted,
                                        repeat, xml_params)

MARKERS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_NAME = re.compile(r"\s*([\w.-]+)\s*")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def parse(body: str) -> list[RawCall]:
    m = _NAME.match(body)
    if m is None:
        raise ValueError(f"GLM tool call does not start with a function name: {body!r:.60}")
    args: dict[str, Any] = {}
    pos = m.end()
    while pos < len(body):
        pair = _PAIR.match(body, pos)
        if pair is None:
            raise ValueError(f"expected <arg_key>k</arg_key><arg_value>v</arg_value> after "
                             f"{m.group(1)!r}, got {body[pos:]!r:.60}")
        args[pair.group(1).strip()] = pair.group(2)
        pos = pair.end()
    return [(m.group(1), args)]


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def open_param(key: str) -> str:
        return f'{lit("<arg_key>")} {quoted(key)} {lit("</arg_key>")} "\\n" {lit("<arg_value>")}'
    params = xml_params(specs, lit, open_param, "</arg_value>")
    calls = alternatives([f'{quoted(name)} "\\n" params{i}' for i, (name, _) in enumerate(specs)])
    one = f'{lit("<tool_call>")} fn {lit("</tool_call>")}'
    return f"start: {repeat('call', single, quoted(chr(10)))}\ncall: {one}\nfn: {calls}\n{params}"


FORMAT = ToolFormat("glm", ("<tool_call>",), "</tool_call>", parse,
                    lambda n: "<tool_call>" + ("" if n is None else n + "\n"), inner=MARKERS,
                    grammar=grammar)
