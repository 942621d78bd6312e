"""Mistral `[TOOL_CALLS]`: v11+ tokenizers (Mistral Small 3.2, Magistral, Devstral) write
`[TOOL_CALLS]name[ARGS]{...}` per call (some with `[CALL_ID]id` before `[ARGS]`); v3 ones
(Mistral 7B v0.3, Nemo, Small 3.1) write `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
No end marker: the calls run to the end of the turn. Pure Python."""
from __future__ import annotations

import json
import re

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, calls_grammar, json_call,
                                        quoted)

START = "[TOOL_CALLS]"
_HEADER = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?\[ARGS\]\s*")


def parse(body: str) -> list[RawCall]:
    calls: list[RawCall] = []
    for piece in body.split(START):
        if piece.strip():
            calls += _piece(piece)
    if not calls:
        raise ValueError("nothing after [TOOL_CALLS]")
    return calls


def _piece(text: str) -> list[RawCall]:
    decoder = json.JSONDecoder()
    if text.lstrip().startswith(("[", "{")):   # v3: a JSON list of calls (or one call)
        try:
            obj, end = decoder.raw_decode(text.lstrip())
        except json.JSONDecodeError as e:
            raise ValueError(f"[TOOL_CALLS] JSON is malformed: {e.msg}") from e
        if text.lstrip()[end:].strip():
            raise ValueError("text follows the [TOOL_CALLS] JSON")
        items = obj if isinstance(obj, list) else [obj]
        return [json_call(item, f"tool call {i}") for i, item in enumerate(items)]
    calls, pos = [], 0
    while pos < len(text.rstrip()):
        m = _HEADER.match(text, pos)
        if m is None:
            raise ValueError(f"expected name[ARGS]{{...}} after [TOOL_CALLS], got {text[pos:]!r:.60}")
        try:
            args, pos = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments of {m.group(1)!r} are not JSON: {e.msg}") from e
        if not isinstance(args, dict):
            raise ValueError(f"arguments of {m.group(1)!r} are not an object")
        calls.append((m.group(1), args))
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        return f'{lit(START)} {quoted(name)} {lit("[ARGS]")} {args}'
    return calls_grammar(specs, single, one)


def grammar_v3(specs: list[Spec], single: bool, lit: Lit) -> str:
    def one(name: str, args: str) -> str:
        head = quoted('{"name": ' + json.dumps(name) + ', "arguments": ')
        return f'{head} {args} "}}"'
    return calls_grammar(specs, single, one, head=f'{lit(START)} "["', tail='"]"', sep='", "')


FORMAT = ToolFormat("mistral", (START,), None, parse,
                    lambda n: START + ("" if n is None else n + "[ARGS]"),
                    inner=("[ARGS]", "[CALL_ID]"), grammar=grammar)
FORMAT_V3 = ToolFormat("mistral_v3", (START,), None, parse,
                       lambda n: START + '[{"name": ' + ("" if n is None else json.dumps(n) + ', "arguments": '),
                       grammar=grammar_v3)
