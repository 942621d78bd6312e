"""Pythonic calls (Llama 4, and models trained like it): `[get_weather(city="Paris"), now()]`
as the turn, optionally between `<|python_start|>` and `<|python_end|>`. Pure Python."""
from __future__ import annotations

import ast
from typing import Any, Callable

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives, json_rule,
                                        python_call, quoted, repeat)


def parse(body: str) -> list[RawCall]:
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"pythonic tool call is not Python: {e.msg}") from e
    node = tree.body
    items = node.elts if isinstance(node, ast.List) else [node]
    calls = [python_call(item, "pythonic tool call") for item in items]
    if not calls:
        raise ValueError("empty pythonic tool-call list")
    return calls


def kwargs_rules(specs: list[Spec], key: Callable[[str], str] = lambda k: quoted(k + "="),
                 sep: str = '", "', value: Callable[[str, dict[str, Any]], str] | None = None,
                 prefix: str = "") -> str:
    """Rules `kw{i}`: a tool's arguments `key(k) <value>` in declared order, separated by `sep`
    (required ones always, optional ones maybe). The value is JSON under the property's schema
    unless `value(rule, prop)` writes it (returning the rule's definitions). JSON strings,
    numbers and lists are Python literals; true/false/null are read as JSON's."""
    out = []
    for i, (_, schema) in enumerate(specs):
        props = list(((schema or {}).get("properties") or {}).items())
        required = set((schema or {}).get("required") or [])
        for j, (_, prop) in enumerate(props):
            prop = prop if isinstance(prop, dict) else {}
            rule = f"{prefix}p{i}_{j}"
            out.append(value(rule, prop) if value is not None else json_rule(rule, prop))
        # f{i}_{j}: the arguments from j on, none written yet; r{i}_{j}: after one was written
        n, f, r = len(props), f"{prefix}f{i}_", f"{prefix}r{i}_"
        out.append(f'{f}{n}: ""\n{r}{n}: ""\n')
        for j in range(n - 1, -1, -1):
            item = f"{key(props[j][0])} {prefix}p{i}_{j}"
            first = f"{item} {r}{j + 1}"
            rest = f"{sep} {item} {r}{j + 1}"
            if props[j][0] not in required:
                first, rest = f"{first} | {f}{j + 1}", f"{rest} | {r}{j + 1}"
            out.append(f"{f}{j}: {first}\n{r}{j}: {rest}\n")
        out.append(f"{prefix}kw{i}: {f}0\n")
    return "".join(out)


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    calls = alternatives([f'{quoted(name + "(")} kw{i} ")"' for i, (name, _) in enumerate(specs)])
    return f'start: "[" {repeat("call", single, quoted(", "))} "]"\ncall: {calls}\n{kwargs_rules(specs)}'


FORMAT = ToolFormat("pythonic", ("<|python_start|>",), "<|python_end|>", parse,
                    lambda n: "[" + ("" if n is None else n + "("), leading="[", grammar=grammar)
