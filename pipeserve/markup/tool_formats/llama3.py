"""Llama 3.x JSON: `{"name": ..., "parameters": {...}}` as the whole turn (several separated
by ';'), or after `<|python_tag|>`. Pure Python."""
from __future__ import annotations

import json

from pipeserve.markup.tool_formats.base import Lit, RawCall, Spec, ToolFormat, calls_grammar, json_call, quoted


def parse(body: str) -> list[RawCall]:
    """One or more JSON objects `{"name", "parameters"}`, separated by ';' or whitespace."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i == len(body):
            break
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool-call JSON is malformed at character {i}: {e.msg}") from e
        calls.append(json_call(obj, f"tool call {len(calls)}"))
    if not calls:
        raise ValueError("no JSON object after the tool-call start")
    return calls


def forced(name: str | None) -> str:
    return '{"name": "' + ("" if name is None else name + '", "parameters":')


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        head = quoted('{"name": ' + json.dumps(name) + ', "parameters": ')
        return f'{head} {args} "}}"'
    return calls_grammar(specs, single, one, sep=quoted("; "))


FORMAT = ToolFormat("llama3", ("<|python_tag|>",), None, parse, forced, leading="{",
                    grammar=grammar)
