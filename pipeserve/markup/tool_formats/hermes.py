"""Hermes / Qwen JSON-in-tags: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one element per call. Pure Python."""
from __future__ import annotations

import json

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, calls_grammar,
                                        json_call, quoted)


def parse(body: str) -> list[RawCall]:
    """`{"name": ..., "arguments": {...}}` (or a list of them) between <tool_call> tags."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool-call body is not JSON: {e}") from e
    items = obj if isinstance(obj, list) else [obj]
    return [json_call(item, "tool call") for item in items]


def forced(name: str | None) -> str:
    return "<tool_call>\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments":')


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        head = quoted('\n{"name": ' + json.dumps(name) + ', "arguments": ')
        return f'{lit("<tool_call>")} {head} {args} "}}\\n" {lit("</tool_call>")}'
    return calls_grammar(specs, single, one, sep=quoted("\n"))


FORMAT = ToolFormat("hermes", ("<tool_call>",), "</tool_call>", parse, forced, grammar=grammar)
