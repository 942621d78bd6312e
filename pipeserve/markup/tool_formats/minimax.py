"""MiniMax-M2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="k">v</parameter>\n
</invoke>\n</minimax:tool_call>`, several invokes per block; values are text, typed by the
tool's schema. Pure Python."""
from __future__ import annotations

import re
from typing import Any

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives, quoted,
                                        repeat, xml_params)

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke name=["\']?([^"\'>]+)["\']?\s*>(.*?)</invoke>', re.DOTALL)
_PARAM = re.compile(r'<parameter name=["\']?([^"\'>]+)["\']?\s*>(.*?)</parameter>', re.DOTALL)


def parse(body: str) -> list[RawCall]:
    if _INVOKE.sub("", body).strip():
        raise ValueError(f"text outside <invoke ...>...</invoke> in the tool call: {body!r:.60}")
    calls = []
    for name, inner in _INVOKE.findall(body):
        if _PARAM.sub("", inner).strip():
            raise ValueError(f"invoke {name!r} holds text outside <parameter ...> elements")
        args: dict[str, Any] = {k.strip(): _trim(v) for k, v in _PARAM.findall(inner)}
        calls.append((name.strip(), args))
    if not calls:
        raise ValueError("no <invoke name=...> inside the tool call")
    return calls


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    params = xml_params(specs, lit, lambda k: quoted(f'<parameter name="{k}">'), "</parameter>\n")
    invokes = [quoted(f'<invoke name="{name}">' + "\n") for name, _ in specs]
    calls = alternatives([f'{head} params{i} "</invoke>\\n"' for i, head in enumerate(invokes)])
    return (f'start: {lit(BEGIN)} "\\n" {repeat("call", single)} {lit(END)}\n'
            f"call: {calls}\n{params}")


FORMAT = ToolFormat("minimax_m2", (BEGIN,), END, parse,
                    lambda n: BEGIN + "\n<invoke name=" + ("" if n is None else f'"{n}">\n'),
                    grammar=grammar)
