"""Tool calls enforced by grammar: for tool_choice "required" or a named tool, the llguidance
grammar of a well-formed call in the model family's own markup, arguments valid under each
tool's schema (strict ones refusing undeclared keys), at most one call when parallel calls are
off, after the think span when the model thinks. Event loop (tokenize); pure Python."""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from pipeserve.grammar.constraint import Constraint, ConstraintKind
from pipeserve.markup.tool_formats import Lit, Spec, ToolFormat
from pipeserve.grammar.think import ThinkSpan, span_grammar

PARAM = "tool_choice"


def marker_lit(added: dict[str, int]) -> Lit:
    """Lark terminals for markers: a marker that is one added token of the served tokenizer is
    that token (`<[id]>`: llguidance keeps added tokens apart from text), anything else text."""
    def lit(marker: str) -> str:
        token = added.get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker, ensure_ascii=False)
    return lit


def tool_specs(tools: list[dict[str, Any]], name: str | None) -> list[Spec]:
    """(name, arguments schema) of the tools a call may name: `name` alone when given. A strict
    tool's schema also refuses keys it does not declare."""
    specs = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        schema = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
        if fn.get("strict"):
            schema.setdefault("additionalProperties", False)
        specs.append((fn["name"], schema))
    return specs


def enforced(fmt: ToolFormat | None, tool_choice: str, tools: list[dict[str, Any]] | None) -> bool:
    """Whether this request's calls are enforced by grammar: a call is required (or named) and
    the family has a grammar."""
    return bool(tools) and fmt is not None and fmt.grammar is not None and \
        tool_choice in ("required", "named")


def tool_constraint(fmt: ToolFormat, tools: list[dict[str, Any]], name: str | None,
                    parallel: bool, lit: Lit, think: ThinkSpan | None = None) -> Constraint:
    """The grammar of this request's call(s); with `think`, after the reasoning span (a
    harmony call then opens its own message)."""
    assert fmt.grammar is not None
    text = fmt.grammar(tool_specs(tools, name), not parallel, lit)
    if think is not None:
        text = span_grammar(think, text)
    return Constraint(ConstraintKind.GRAMMAR, text, PARAM, whole_turn=True)


def strict_auto_constraint(fmt: ToolFormat | None, tools: list[dict[str, Any]] | None,
                           parallel: bool, lit: Lit, added: dict[str, int],
                           stop_ids: frozenset[int], think: ThinkSpan | None = None
                           ) -> Constraint | None:
    """tool_choice auto with a `strict` tool: the model writes what it likes, but a call it
    opens is finished well-formed and schema-valid. Only for families whose call opens with
    one added token (free text can never spell it); None otherwise."""
    if not tools or fmt is None or fmt.grammar is None or fmt.leading is not None:
        return None
    if not any(t["function"].get("strict") for t in tools):
        return None
    opener = lit(fmt.starts[0])
    if not opener.startswith("<["):
        return None
    calls = fmt.grammar(tool_specs(tools, None), not parallel, lit)
    calls = re.sub(r"^start:", "calls:", calls, count=1, flags=re.MULTILINE)
    others = sorted(set(added.values()) - {added[fmt.starts[0]]} - stop_ids)
    piece = "TEXT" + (f" | <[{','.join(map(str, others))}]>" if others else "")
    text = (f"start: free (calls free){'?' if not parallel else '*'}\nfree: piece*\n"
            f"piece: {piece}\nTEXT: /(?s:.+)/\n{calls}")
    if think is not None:
        text = span_grammar(think, text)
    return Constraint(ConstraintKind.GRAMMAR, text, "tools", whole_turn=True)
