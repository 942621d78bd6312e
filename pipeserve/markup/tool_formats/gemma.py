"""Gemma's families: Gemma 2/3 ```tool_code``` Python calls, FunctionGemma
`<start_function_call>call:f{a:<escape>v<escape>}<end_function_call>` and Gemma 4
`<|tool_call>call:f{a:<|"|>v<|"|>}<tool_call|>`. Pure Python."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives, json_rule,
                                        python_call, quoted, repeat, text_until)
from pipeserve.markup.tool_formats.pythonic import kwargs_rules


def parse_tool_code(body: str) -> list[RawCall]:
    """Python calls, one per line, keyword arguments only: `get_weather(city="Paris")`,
    optionally wrapped in print(...)."""
    try:
        tree = ast.parse(body.strip())
    except SyntaxError as e:
        raise ValueError(f"tool_code is not Python: {e.msg}") from e
    calls = []
    for stmt in tree.body:
        node = stmt.value if isinstance(stmt, ast.Expr) else None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "print" and len(node.args) == 1):
            node = node.args[0]
        if node is None:
            raise ValueError("tool_code holds something other than name(key=value, ...) calls")
        calls.append(python_call(node, "tool_code"))
    if not calls:
        raise ValueError("empty tool_code block")
    return calls


class _CallReader:
    """Reads Gemma's `call:name{key:value,...}`: bare keys, strings between `quote` marks,
    nested {} and [], other scalars as JSON where they parse."""

    def __init__(self, text: str, quote: str) -> None:
        self.text, self.quote, self.i = text, quote, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"{what} at character {self.i} of {self.text!r:.80}")

    def value(self) -> Any:
        t = self.text
        if t.startswith(self.quote, self.i):
            end = t.find(self.quote, self.i + len(self.quote))
            if end < 0:
                raise self.error("unterminated string")
            start, self.i = self.i + len(self.quote), end + len(self.quote)
            return t[start:end]
        if t.startswith("{", self.i):
            return self.container("}", keyed=True)
        if t.startswith("[", self.i):
            return self.container("]", keyed=False)
        m = re.compile(r"[^,}\]]*").match(t, self.i)
        assert m is not None
        self.i = m.end()
        raw = m.group().strip()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def container(self, close: str, keyed: bool) -> Any:
        self.i += 1
        out: Any = {} if keyed else []
        while not self.text.startswith(close, self.i):
            if keyed:
                colon = self.text.find(":", self.i)
                if colon < 0:
                    raise self.error("missing ':' after a key")
                key, self.i = self.text[self.i:colon].strip(), colon + 1
                out[key] = self.value()
            else:
                out.append(self.value())
            if self.text.startswith(",", self.i):
                self.i += 1
            elif not self.text.startswith(close, self.i):
                raise self.error(f"expected ',' or '{close}'")
        self.i += 1
        return out


def _gemma_calls(body: str, quote: str) -> list[RawCall]:
    calls, rest = [], body.strip()
    while rest:
        m = re.match(r"call:([\w.-]+)\s*", rest)
        if m is None or not rest.startswith("{", m.end()):
            raise ValueError(f"expected call:name{{...}}, got {rest!r:.60}")
        reader = _CallReader(rest, quote)
        reader.i = m.end()
        calls.append((m.group(1), reader.container("}", keyed=True)))
        rest = rest[reader.i:].strip()
    if not calls:
        raise ValueError("no call:name{...} inside the tool call")
    return calls



def tool_code_grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    calls = alternatives([f'{quoted(name + "(")} kw{i} ")"' for i, (name, _) in enumerate(specs)])
    return (f'start: "```tool_code\\n" {repeat("call", single, quoted(chr(10)))} "\\n```"\n'
            f"call: {calls}\n{kwargs_rules(specs)}")


def call_grammar(quote: str, begin: str, end: str) -> Callable[[list[Spec], bool, Lit], str]:
    """FunctionGemma / Gemma 4: `begin call:NAME{k:v,...} end` per call, string values between
    `quote` marks (free text that never holds one; at most maxLength), other values JSON."""
    def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
        def value(rule: str, prop: dict[str, Any]) -> str:
            if prop.get("type") != "string" or "enum" in prop:
                return json_rule(rule, prop)
            limit = prop.get("maxLength") if isinstance(prop.get("maxLength"), int) else None
            ref, definition = text_until(rule.upper() + "T", quote, lit, limit)
            return f"{rule}: {lit(quote)} {ref}\n{definition}"
        calls = alternatives([f'{lit(begin)} {quoted("call:" + name + "{")} kw{i} "}}" {lit(end)}'
                              for i, (name, _) in enumerate(specs)])
        rules = kwargs_rules(specs, key=lambda k: quoted(k + ":"), sep='","', value=value)
        return f"start: {repeat('call', single)}\ncall: {calls}\n{rules}"
    return grammar


GEMMA = ToolFormat("gemma", ("```tool_code",), "```", parse_tool_code,
                   lambda n: "```tool_code\n" + (n + "(" if n else ""), grammar=tool_code_grammar)
FUNCTION_GEMMA = ToolFormat("function_gemma", ("<start_function_call>",), "<end_function_call>",
                            lambda b: _gemma_calls(b, "<escape>"),
                            lambda n: "<start_function_call>call:" + (n + "{" if n else ""),
                            grammar=call_grammar("<escape>", "<start_function_call>",
                                                 "<end_function_call>"))
GEMMA4 = ToolFormat("gemma4", ("<|tool_call>",), "<tool_call|>", lambda b: _gemma_calls(b, '<|"|>'),
                    lambda n: "<|tool_call>call:" + (n + "{" if n else ""),
                    grammar=call_grammar('<|"|>', "<|tool_call>", "<tool_call|>"))
