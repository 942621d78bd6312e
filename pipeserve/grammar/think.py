"""The reasoning span as grammar: thinking of at most a budget of tokens, closed by the
model's end-of-thinking marker (forced once the budget is spent), then the answer — free text,
or a grammar such as a required tool call. Markers are written as the token ids they encode to,
so the marker the grammar forces is the one the model was trained on. Event loop (tokenize);
pure Python."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeserve.markup.tool_formats.base import regex_literal


@dataclass(frozen=True)
class ThinkSpan:
    """`opened`: the prompt already opened the span (the model starts inside it). `budget`:
    the most tokens of thinking (None: no limit). `after`: text the model writes between the
    span's close and the answer (harmony's next message header)."""

    open_text: str
    open_ids: tuple[int, ...]
    close_text: str
    close_ids: tuple[int, ...]
    opened: bool
    budget: int | None = None
    after_ids: tuple[int, ...] = ()
    special_ids: tuple[int, ...] = ()   # added tokens unbudgeted reasoning may hold
    newlines: bool = True               # a newline or two may stand around the span's markers


def _tokens(ids: tuple[int, ...]) -> str:
    return " ".join(f"<[{i}]>" for i in ids)


def span_grammar(span: ThinkSpan, answer: str | None = None) -> str:
    """Lark for the turn: the span, then `answer` (a grammar whose `start` is the answer) or
    any text. When the prompt did not open the span the model may also answer at once."""
    limit = f"[max_tokens={span.budget}]" if span.budget is not None else ""
    close = _tokens(span.close_ids)
    after = _tokens(span.after_ids)
    # a budget makes `think` one lexeme, and a lexeme holds text only: budgeted reasoning
    # cannot hold added tokens; unbudgeted reasoning may
    special = f" | <[{','.join(map(str, span.special_ids))}]>" if span.special_ids and not limit else ""
    body = f"(THINK{special})+" if special else "THINK"
    lines = [f"think_span: think? {close}",
             f"think{limit}: {body}",
             f"THINK: /(?s:.+)/ & ~/(?s:.*{regex_literal(span.close_text)}.*)/",
             "WS: /\\n{1,2}/"]
    if answer is None:
        # the free answer may hold added tokens (a tool call's <tool_call>, say); answering at
        # once must not start with the opening marker (that path is the span's)
        tokens = f" | <[{','.join(map(str, span.special_ids))}]>" if span.special_ids else ""
        lines.append(f"rest: piece*\npiece: ANSWER{tokens}\nANSWER: /(?s:.+)/")
        direct = (f"PLAIN: /(?s:.+)/ & ~/(?s:\\n*{regex_literal(span.open_text)}.*)/\n"
                  f"plain: PLAIN piece*{' | ' + tokens[3:] + ' piece*' if tokens else ''}")
        plain = "plain"
    else:
        lines.append(re.sub(r"^start:", "rest:", answer, count=1, flags=re.MULTILINE).rstrip())
        direct, plain = "", "rest"
    ws = "WS? " if span.newlines else ""
    if span.opened:
        start = f"start: think_span {ws}{after} rest"
    else:
        start = f"start: {ws}{_tokens(span.open_ids)} think_span {ws}{after} rest | {plain}"
        if direct:
            lines.append(direct)
    return "\n".join([start, *lines]) + "\n"
