"""The tool-call markup of each model family: markers, the assistant-turn prefix that forces a
call, and the parser of one call body → (name, arguments). Event loop; pure Python."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

# A parsed call before schema checks: name and arguments (values may still be text, as XML
# markup writes them; the schema types them).
RawCall = tuple[str, dict[str, Any]]


def _json_call(obj: Any, where: str) -> RawCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"{where} is not an object with a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} has arguments that are a string but not JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError(f"{where} has arguments that are not an object: {args!r:.60}")
    return obj["name"], args


def parse_hermes(body: str) -> list[RawCall]:
    """`{"name": ..., "arguments": {...}}` (or a list of them) between <tool_call> tags."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool-call body is not JSON: {e}") from e
    items = obj if isinstance(obj, list) else [obj]
    return [_json_call(item, "tool call") for item in items]


def parse_llama3(body: str) -> list[RawCall]:
    """One or more JSON objects `{"name", "parameters"}`, separated by ';' or whitespace."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i == len(body):
            break
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool-call JSON is malformed at character {i}: {e.msg}") from e
        calls.append(_json_call(obj, f"tool call {len(calls)}"))
    if not calls:
        raise ValueError("no JSON object after the tool-call start")
    return calls


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder(body: str) -> list[RawCall]:
    """`<function=name><parameter=p>\\nvalue\\n</parameter></function>`; values are text."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        if "<parameter=" in _PARAMETER.sub("", inner):
            raise ValueError(f"function {name.strip()!r} has an unterminated <parameter=...>")
        args: dict[str, Any] = {}
        for key, value in _PARAMETER.findall(inner):
            value = value[1:] if value.startswith("\n") else value
            args[key.strip()] = value[:-1] if value.endswith("\n") else value
        calls.append((name.strip(), args))
    if not calls:
        raise ValueError("no <function=...> block inside the tool call")
    return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    return ast.literal_eval(node)


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):   # default_api.get_weather → get_weather
        return func.attr
    return None


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
        if (isinstance(node, ast.Call) and _call_name(node.func) == "print"
                and len(node.args) == 1):
            node = node.args[0]
        if not isinstance(node, ast.Call) or node.args or _call_name(node.func) is None:
            raise ValueError("tool_code holds something other than name(key=value, ...) calls")
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except ValueError as e:
            raise ValueError(f"tool_code argument is not a literal: {e}") from e
        calls.append((_call_name(node.func) or "", args))
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


@dataclass(frozen=True)
class ToolFormat:
    """One family's markup. `starts` open a call anywhere in the text; `leading` opens one
    only as the first non-space text of the turn and stays part of the body; `end` closes a
    call (None: the call runs to the end of the output)."""

    name: str
    starts: tuple[str, ...]
    end: str | None
    parse: Callable[[str], list[RawCall]]
    forced: Callable[[str | None], str]   # tool name (None: any) → assistant-turn prefix
    leading: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return self.starts + ((self.end,) if self.end else ())


def _hermes_prefix(name: str | None) -> str:
    return "<tool_call>\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments":')


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", ("<tool_call>",), "</tool_call>", parse_hermes, _hermes_prefix),
    ToolFormat("qwen3_coder", ("<tool_call>",), "</tool_call>", parse_qwen3_coder,
               lambda n: "<tool_call>\n<function=" + ("" if n is None else n + ">\n")),
    ToolFormat("llama3", ("<|python_tag|>",), None, parse_llama3,
               lambda n: '{"name": "' + ("" if n is None else n + '", "parameters":'),
               leading="{"),
    ToolFormat("gemma", ("```tool_code",), "```", parse_tool_code,
               lambda n: "```tool_code\n" + (n + "(" if n else "")),
    ToolFormat("function_gemma", ("<start_function_call>",), "<end_function_call>",
               lambda b: _gemma_calls(b, "<escape>"),
               lambda n: "<start_function_call>call:" + (n + "{" if n else "")),
    ToolFormat("gemma4", ("<|tool_call>",), "<tool_call|>", lambda b: _gemma_calls(b, '<|"|>'),
               lambda n: "<|tool_call>call:" + (n + "{" if n else "")),
)}
