"""LongCat: `<longcat_tool_call>NAME\n<longcat_arg_key>k</longcat_arg_key>\n<longcat_arg_value>v
</longcat_arg_value>...</longcat_tool_call>` (GLM's shape, prefixed), or a JSON object
`{"name", "arguments"}` inside the same tags. Values are text, typed by the tool's schema. Pure
Python."""
from __future__ import annotations

import json
import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives,
                                                json_call, quoted, repeat, xml_params)

BEGIN, END = "<longcat_tool_call>", "</longcat_tool_call>"
KEY, KEY_END = "<longcat_arg_key>", "</longcat_arg_key>"
VALUE, VALUE_END = "<longcat_arg_value>", "</longcat_arg_value>"
_NAME = re.compile(r"\s*([\w.-]+)\s*")
# the templates write a newline between key and value, some as a literal backslash-n
_PAIR = re.compile(re.escape(KEY) + r"(.*?)" + re.escape(KEY_END) + r"(?:\\n|\s)*"
                   + re.escape(VALUE) + r"(.*?)" + re.escape(VALUE_END) + r"(?:\\n|\s)*",
                   re.DOTALL)


def parse(body: str) -> list[RawCall]:
    if body.strip().startswith("{"):
        try:
            return [json_call(json.loads(body), "LongCat JSON tool call")]
        except json.JSONDecodeError as e:
            raise ValueError(f"LongCat JSON tool call is not JSON: {e}") from e
    m = _NAME.match(body)
    if m is None:
        raise ValueError(f"LongCat tool call does not start with a function name: {body!r:.60}")
    args: dict[str, Any] = {}
    pos = m.end()
    while pos < len(body):
        pair = _PAIR.match(body, pos)
        if pair is None:
            raise ValueError(f"expected {KEY}k{KEY_END}{VALUE}v{VALUE_END} after "
                             f"{m.group(1)!r}, got {body[pos:]!r:.60}")
        args[pair.group(1).strip()] = pair.group(2).strip()
        pos = pair.end()
    return [(m.group(1), args)]


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def open_param(key: str) -> str:
        return f'{lit(KEY)} {quoted(key)} {lit(KEY_END)} "\\n" {lit(VALUE)}'
    params = xml_params(specs, lit, open_param, VALUE_END)
    calls = alternatives([f'{quoted(name)} "\\n" params{i}' for i, (name, _) in enumerate(specs)])
    one = f"{lit(BEGIN)} fn {lit(END)}"
    return f"start: {repeat('call', single, quoted(chr(10)))}\ncall: {one}\nfn: {calls}\n{params}"


FORMAT = ToolFormat("longcat", (BEGIN,), END, parse,
                    lambda n: BEGIN + ("" if n is None else n + "\n"),
                    inner=(KEY, KEY_END, VALUE, VALUE_END), grammar=grammar)
