"""Step-3 (StepFun): `<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>
<steptml:invoke name="NAME"><steptml:parameter name="k">v</steptml:parameter></steptml:invoke>
<｜tool_call_end｜><｜tool_calls_end｜>`, one `tool_call_begin … tool_call_end` per call (the
bars are fullwidth U+FF5C, the separators plain `_`, unlike DeepSeek's `▁`). Values are text,
typed by the tool's schema. Pure Python."""
from __future__ import annotations

import re

from pipeserve.markup.tool_formats.base import (Lit, RawCall, Spec, ToolFormat, alternatives,
                                                quoted, repeat, xml_params)

BEGIN, END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
CALL, SEP, CALL_END = "<｜tool_call_begin｜>", "<｜tool_sep｜>", "<｜tool_call_end｜>"
_CALL = re.compile(re.escape(CALL) + r"\s*function\s*" + re.escape(SEP) + r"(.*?)"
                   + re.escape(CALL_END), re.DOTALL)
_INVOKE = re.compile(r'\s*<steptml:invoke name="([^"]+)">(.*?)</steptml:invoke>\s*', re.DOTALL)
_PARAM = re.compile(r'<steptml:parameter name="([^"]+)">(.*?)</steptml:parameter>', re.DOTALL)


def parse(body: str) -> list[RawCall]:
    if _CALL.sub("", body).strip():
        raise ValueError(f"text outside {CALL}function{SEP}…{CALL_END} in the tool call: "
                         f"{body!r:.60}")
    calls = []
    for inner in _CALL.findall(body):
        invoke = _INVOKE.fullmatch(inner)
        if invoke is None:
            raise ValueError(f"expected one <steptml:invoke name=...> after {SEP}: {inner!r:.60}")
        name, params = invoke.groups()
        if _PARAM.sub("", params).strip():
            raise ValueError(f"invoke {name!r} holds text outside <steptml:parameter ...> "
                             "elements")
        calls.append((name.strip(), {k.strip(): v for k, v in _PARAM.findall(params)}))
    if not calls:
        raise ValueError(f"no {CALL} inside the tool call")
    return calls


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    params = xml_params(specs, lit, lambda k: quoted(f'<steptml:parameter name="{k}">'),
                        "</steptml:parameter>")
    heads = [f'{lit(CALL)} "function" {lit(SEP)} ' + quoted(f'<steptml:invoke name="{name}">')
             for name, _ in specs]
    calls = alternatives([f'{head} params{i} "</steptml:invoke>" {lit(CALL_END)}'
                          for i, head in enumerate(heads)])
    return (f'start: {lit(BEGIN)} {repeat("call", single)} {lit(END)}\n'
            f"call: {calls}\n{params}")


FORMAT = ToolFormat("step3", (BEGIN,), END, parse,
                    lambda n: (BEGIN + CALL + "function" + SEP + "<steptml:invoke name="
                               + ("" if n is None else f'"{n}">')),
                    inner=(CALL, SEP, CALL_END), grammar=grammar)
