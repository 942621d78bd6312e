"""What every tool-call family module defines: the ToolFormat record (markers, parser, forced
prefix, grammar) and the helpers the parsers and grammars share. Event loop; pure Python."""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Callable

# A parsed call before schema checks: name and arguments (values may still be text, as XML
# markup writes them; the schema types them).
RawCall = tuple[str, dict[str, Any]]
# A marker → its Lark terminal for the served tokenizer: `<[id]>` where the marker is one
# (special) token, else a quoted literal. Grammars write every marker through it.
Lit = Callable[[str], str]
# (tool name, its JSON parameters schema) for each tool a grammar may call.
Spec = tuple[str, dict[str, Any]]
# (specs, at most one call?, lit) → a Lark grammar whose `start` is the call markup.
Grammar = Callable[[list[Spec], bool, Lit], str]


@dataclass(frozen=True)
class ToolFormat:
    """One family's markup. `starts` open a call anywhere in the text; `leading` opens one
    only as the first non-space text of the turn and stays part of the body; `end` closes a
    call (None: the call runs to the end of the output). `inner` are the other markers a call
    holds (decoding keeps them). `grammar` builds the llguidance grammar that enforces a
    well-formed call (None: the family's calls cannot be enforced)."""

    name: str
    starts: tuple[str, ...]
    end: str | None
    parse: Callable[[str], list[RawCall]]
    forced: Callable[[str | None], str]   # tool name (None: any) → assistant-turn prefix
    leading: str | None = None
    inner: tuple[str, ...] = ()
    grammar: Grammar | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return self.starts + ((self.end,) if self.end else ())


def json_call(obj: Any, where: str) -> RawCall:
    """`{"name": ..., "arguments" | "parameters": {...} or a JSON string}` → a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"{where} is not an object with a string 'name'")
    return obj["name"], json_args(obj.get("arguments", obj.get("parameters", {})), where)


def json_args(args: Any, where: str) -> dict[str, Any]:
    """Arguments as an object: a JSON string is decoded; anything but an object is refused."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} has arguments that are a string but not JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError(f"{where} has arguments that are not an object: {args!r:.60}")
    return args


def json_object(text: str, where: str) -> dict[str, Any]:
    """Exactly one JSON object (surrounding whitespace allowed)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from e
    return json_args(value, where)


_JSON_NAMES = {"true": True, "false": False, "null": None}


def literal(node: ast.expr) -> Any:
    """A Python literal, with JSON's true/false/null as templates render nested values."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):   # default_api.get_weather → get_weather
        return func.attr
    return None


def python_call(node: ast.expr, where: str) -> RawCall:
    """`name(key=literal, ...)` → a call; positional arguments are refused."""
    name = call_name(node.func) if isinstance(node, ast.Call) else None
    if not isinstance(node, ast.Call) or node.args or name is None:
        raise ValueError(f"{where} holds something other than name(key=value, ...) calls")
    try:
        return name, {kw.arg: literal(kw.value) for kw in node.keywords if kw.arg}
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"{where} has an argument that is not a literal: {e}") from e


# -- grammar helpers ---------------------------------------------------------------------------
def quoted(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text, ensure_ascii=False)


def args_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a call's arguments are generated under: the tool's parameters as given,
    an object at least."""
    out = dict(schema or {})
    out.setdefault("type", "object")
    return out


# JSON inside a call is written as the templates write it (json.dumps: ", " and ": "), so a
# model cannot spend its tokens on whitespace between the values of an argument object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(name: str, schema: dict[str, Any]) -> str:
    """A Lark rule `name` matching JSON valid under `schema` (llguidance's %json)."""
    body = {**args_schema(schema), "x-guidance": JSON_OPTIONS}
    return f"{name}: %json {json.dumps(body, ensure_ascii=False)}\n"


def alternatives(rules: list[str]) -> str:
    return " | ".join(rules)


def repeat(item: str, single: bool, sep: str = "") -> str:
    """`item` once (single) or one or more times separated by `sep` (a Lark expression)."""
    if single:
        return item
    return f"{item} ({sep} {item})*" if sep else f"{item}+"


def calls_grammar(specs: list[Spec], single: bool, one: Callable[[str, str], str],
                  head: str = "", tail: str = "", sep: str = "") -> str:
    """The usual shape: `head`, one call (or several, separated by `sep`), `tail`, where
    `one(name, args_rule)` writes one call of a tool whose JSON arguments are `args_rule`."""
    rules = "".join(json_rule(f"args{i}", schema) for i, (_, schema) in enumerate(specs))
    calls = alternatives([one(name, f"args{i}") for i, (name, _) in enumerate(specs)])
    return (f"start: {head} {repeat('call', single, sep)} {tail}\n"
            f"call: {calls}\n{rules}")


def text_until(name: str, close: str, lit: Lit, max_chars: int | None = None) -> tuple[str, str]:
    """(reference, definition): any text (at most `max_chars`) up to and including the first
    `close` marker. A text marker makes one terminal (text that never holds the marker, then the
    marker: a greedy lexeme must end where the marker does); a token marker a rule."""
    text = "(?s:.*)" if max_chars is None else f"(?s:.{{0,{max_chars}}})"
    if lit(close).startswith("<["):   # text never holds a special token
        return name.lower(), f"{name.lower()}: /{text}/ {lit(close)}\n"
    return name.upper(), (f"{name.upper()}: (/{text}/ & ~/(?s:.*{regex_literal(close)}.*)/) "
                          f"{lit(close)}\n")


REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/: punctuation escaped, control characters as
    escapes (a raw newline would end the regex)."""
    out = []
    for ch in text:
        if ch not in REGEX_META:
            out.append(ch)
        elif ch in "\n\t\r":
            out.append({"\n": r"\n", "\t": r"\t", "\r": r"\r"}[ch])
        else:
            out.append("\\" + ch)
    return "".join(out)


def xml_params(specs: list[Spec], lit: Lit, open_param: Callable[[str], str], close: str,
               after: Callable[[str], str] | None = None) -> str:
    """Rules `params{i}` for tools whose arguments are written one element each: for every
    declared property in order, `open_param(key)`, the value, `close` (optional unless
    required). String values are free text (that never holds `close`; at most maxLength),
    others JSON valid under the property's schema. `after(key)`: grammar text that follows
    `close` (a closing tag named after the key, where `close` is only its prefix)."""
    out = []
    for i, (_, schema) in enumerate(specs):
        props = (schema or {}).get("properties") or {}
        required = set((schema or {}).get("required") or [])
        items = []
        for j, (key, prop) in enumerate(props.items()):
            prop = prop if isinstance(prop, dict) else {}
            if prop.get("type") == "string" and "enum" not in prop:
                limit = prop.get("maxLength") if isinstance(prop.get("maxLength"), int) else None
                value, rule = text_until(f"s{i}_{j}", close, lit, limit)
                out.append(rule)
            else:
                value = f"v{i}_{j} {lit(close)}"
                out.append(json_rule(f"v{i}_{j}", prop))
            if after is not None:
                value += f" {after(key)}"
            item = f"{open_param(key)} {value}"
            items.append(item if key in required else f"({item})?")
        out.append(f"params{i}: {' '.join(items) or quoted('')}\n")
    return "".join(out)
