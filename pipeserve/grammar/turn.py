"""The grammar a turn is decoded under when the server shapes it: a required (or named) tool
call, a thinking budget, or both — the think span first (pipeserve/grammar/think.py), then the
call (pipeserve/grammar/tool.py) or free text. Built by tokenize once the prompt is rendered.
Event loop; pure Python (the tokenizer only encodes markers)."""
from __future__ import annotations

import json
from typing import Any, Callable

from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import JSON_OPTIONS, Constraint, ConstraintKind
from pipeserve.markup.output import OutputMarkup
from pipeserve.request import Request
from pipeserve.grammar.think import ThinkSpan, span_grammar
from pipeserve.grammar.tool import enforced, marker_lit, strict_auto_constraint, tool_constraint

# harmony: the analysis message opens and closes the reasoning; the next message's header follows
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant")
HARMONY_FINAL = "<|channel|>final<|message|>"


class TurnGrammars:
    """`encode(text)`: the served tokenizer's ids of a marker. `thinking_default`: whether a
    request that says nothing thinks. `budgets`: model.reasoning_budgets."""

    def __init__(self, markup: OutputMarkup, tokenizer: Any, encode: Callable[[str], list[int]],
                 budgets: dict[str, int], thinking_default: bool | None) -> None:
        self.markup, self.encode, self.budgets = markup, encode, dict(budgets)
        self.thinking_default = thinking_default
        self.added = added_tokens(tokenizer)
        self.lit = marker_lit(self.added)
        self.stop_ids = frozenset(tokenizer.eos_token_ids)

    def constraint(self, request: Request, opened: str, prefill: str) -> Constraint | None:
        """The turn's grammar, or None (the request's own constraint, if any, stands)."""
        inputs, fmt = request.inputs, self.markup.tool_format
        # a prefill holds the answer's start: no span starts after it
        span = None if prefill else self.think_span(request, opened)
        if enforced(fmt, inputs.tool_choice, inputs.tools):
            assert fmt is not None and inputs.tools
            if prefill:
                raise InvalidRequest(
                    f"tool_choice {inputs.tool_choice!r} makes the answer a tool call, but the "
                    "final assistant message prefills it with text; drop one of them",
                    param="tool_choice")
            if request.constraint is not None:
                raise InvalidRequest(
                    f"tool_choice {inputs.tool_choice!r} and {request.constraint.param} both "
                    "constrain the output; a required tool call is the whole answer — send one "
                    "of them", param=request.constraint.param)
            return tool_constraint(fmt, inputs.tools,
                                   inputs.tool_name if inputs.tool_choice == "named" else None,
                                   inputs.parallel_tool_calls, self.lit, span)
        if request.constraint is None and inputs.tool_choice == "auto" and not prefill:
            strict = strict_auto_constraint(fmt, inputs.tools, inputs.parallel_tool_calls,
                                            self.lit, self.added, self.stop_ids, span)
            if strict is not None:
                return strict
        if span is not None and request.constraint is not None:
            return self._after_span(request.constraint, span)
        if span is not None and span.budget is not None:
            return Constraint(ConstraintKind.GRAMMAR, span_grammar(span), "max_reasoning_tokens",
                              whole_turn=True)
        return None

    def _after_span(self, c: Constraint, span: ThinkSpan) -> Constraint:
        """Structured output on a thinking turn: the reasoning, then the constrained answer.
        A grammar the client wrote (Lark or GBNF) cannot be joined to the span: a 400."""
        # harmony: the answer is a final-channel message
        head = (" ".join(f"<[{t}]>" for t in self.encode(HARMONY_FINAL))
                if self.markup.channels else "")
        answer = answer_grammar(c, head)
        if answer is None:
            raise InvalidRequest(
                f"{c.param} cannot be honoured after the think span (a grammar joins only "
                "JSON, regex and choice constraints to it); turn thinking off (reasoning_effort "
                "'none') or send a JSON schema", param=c.param)
        return Constraint(ConstraintKind.GRAMMAR, span_grammar(span, answer), c.param,
                          whole_turn=True)

    def thinking(self, request: Request) -> bool:
        """Whether the template is asked to think (the request's switch, else the default)."""
        default = self.thinking_default
        on = request.inputs.template_kwargs.get(
            "enable_thinking", self.markup.think is not None if default is None else default)
        return on is not False

    def think_span(self, request: Request, opened: str) -> ThinkSpan | None:
        """The reasoning span a turn grammar starts with: the model's markers as tokens, whether
        the prompt opened it, the budget (the request's, else its effort's from
        model.reasoning_budgets). None when the model does not think or thinking is off."""
        m, inputs = self.markup, request.inputs
        if m.channels:   # harmony: an analysis message, then the next message's header
            open_text, close_text, after = HARMONY_ANALYSIS
        elif m.think is not None and (opened or self.thinking(request)):
            open_text, close_text, after = m.think.start, m.think.end, ""
        else:
            return None
        budget = inputs.reasoning_budget
        effort = inputs.template_kwargs.get("reasoning_effort")
        if budget is None and isinstance(effort, str):
            budget = self.budgets.get(effort)
        max_tokens = request.requested.max_tokens
        if budget is not None and isinstance(max_tokens, int) and max_tokens <= budget:
            budget = None   # the turn ends before the budget could: nothing to force
        ids = lambda t: tuple(self.encode(t)) if t else ()   # noqa: E731
        markers = set(ids(open_text)) | set(ids(close_text))
        special = tuple(sorted(set(self.added.values()) - markers - self.stop_ids))
        return ThinkSpan(open_text, ids(open_text), close_text, ids(close_text), bool(opened),
                         budget, ids(after), special, newlines=not m.channels)


def added_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (text → id): grammars name them as tokens, not text."""
    try:
        added = tokenizer.added_tokens_decoder
    except AttributeError:
        return {}
    return {str(getattr(t, "content", t)): int(i) for i, t in added.items()}


def answer_grammar(c: Constraint, head: str = "") -> str | None:
    """A structured-output constraint as a Lark grammar whose `start` is `head` (Lark) then the
    answer (None: a client's own grammar, which cannot be renamed safely)."""
    if c.kind in (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA):
        schema = {**json.loads(c.source), "x-guidance": JSON_OPTIONS}
        body = f"%json {json.dumps(schema, ensure_ascii=False)}"
    elif c.kind is ConstraintKind.REGEX:
        body = "/" + c.source.replace("/", "\\/") + "/"
    elif c.kind is ConstraintKind.CHOICE:
        body = "(" + " | ".join(json.dumps(x, ensure_ascii=False) for x in json.loads(c.source)) + ")"
    else:
        return None
    return f"start: {head} {body}\n"
