"""gpt-oss harmony tool calls. The model writes a call as a commentary-channel message to a
recipient, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(or with the recipient before the channel, `<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>...`). The harmony splitter (pipeserve/http/api/harmony.py) reads the
channels and hands every call on in the first, canonical spelling, which this parser reads.
Pure Python."""
from __future__ import annotations

import re

from pipeserve.markup.tool_formats.base import Lit, RawCall, Spec, ToolFormat, alternatives, json_object, json_rule, quoted

START = "<|channel|>commentary to="
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>",
           "<|return|>")
_HEAD = re.compile(r"\s*([^\s<]+)\s*(?:<\|constrain\|>\s*\S*?\s*)?(?:json\s*)?<\|message\|>", re.DOTALL)


def parse(body: str) -> list[RawCall]:
    """`functions.NAME [<|constrain|>json]<|message|>{json}` (after START, before <|call|>)."""
    m = _HEAD.match(body)
    if m is None:
        raise ValueError("harmony call has no '<recipient> ... <|message|>' header")
    recipient = m.group(1)
    if not recipient.startswith("functions.") or len(recipient) == len("functions."):
        raise ValueError(f"harmony message goes to {recipient!r}, not to a function tool "
                         "('functions.<name>')")
    return [(recipient[len("functions."):], json_object(body[m.end():], "harmony call arguments"))]


def canonical(recipient: str) -> str:
    """How the splitter spells a call's header for the parser."""
    return f"{START}{recipient} <|constrain|>json<|message|>"


def forced(name: str | None) -> str:
    return START + "functions." + ("" if name is None else name + " <|constrain|>json<|message|>")


def grammar(specs: list[Spec], single: bool, lit: Lit) -> str:
    # one call per message: the model stops at <|call|> (an end-of-generation token)
    rules = "".join(json_rule(f"args{i}", s) for i, (_, s) in enumerate(specs))
    calls = alternatives([f'{quoted("commentary to=functions." + name + " ")} '
                          f'{lit("<|constrain|>")} "json" {lit("<|message|>")} args{i}'
                          for i, (name, _) in enumerate(specs)])
    return f"start: {lit('<|channel|>')} call\ncall: {calls}\n{rules}"


FORMAT = ToolFormat("harmony", (START,), "<|call|>", parse, forced, inner=MARKERS,
                    grammar=grammar)
