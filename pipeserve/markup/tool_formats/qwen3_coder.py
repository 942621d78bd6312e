"""Qwen3-Coder XML: `<tool_call>\n<function=name>\n<parameter=p>\nvalue\n</parameter>\n
</function>\n</tool_call>`; values are text, typed by the schema. Pure Python."""
from __future__ import annotations

import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives, quoted,
                                        repeat, xml_params)

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse(body: str) -> list[RawCall]:
    """`<function=name><parameter=p>\\nvalue\\n</parameter></function>`; values are text."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        if "<parameter=" in _PARAMETER.sub("", inner):
            raise ValueError(f"function {name.strip()!r} has an unterminated <parameter=...>")
        args: dict[str, Any] = {}
        for key, value in _PARAMETER.findall(inner):
            value = value[1:] if value.startswith("\n") else value
            args[key.strip()] = value[:-1] if value.endswith("\n") else value
        calls.append((name.strip(), args))
    if not calls:
        raise ValueError("no <function=...> block inside the tool call")
    return calls


def forced(name: str | None) -> str:
    return "<tool_call>\n<function=" + ("" if name is None else name + ">\n")


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    params = xml_params(specs, lit, lambda k: quoted(f"<parameter={k}>\n"), "\n</parameter>\n")
    calls = alternatives([f'{quoted(f"<function={name}>" + chr(10))} params{i}'
                          for i, (name, _) in enumerate(specs)])
    one = f'{lit("<tool_call>")} "\\n" fn "</function>\\n" {lit("</tool_call>")}'
    return f"start: {repeat('call', single, quoted(chr(10)))}\ncall: {one}\nfn: {calls}\n{params}"


FORMAT = ToolFormat("qwen3_coder", ("<tool_call>",), "</tool_call>", parse, forced,
                    grammar=grammar)
