"""The `tools` of a Responses request as agents send them (Codex: functions beside `custom`
freeform tools, `web_search`, `local_shell`, `image_generation`, `namespace` ...): function
tools as they are, custom tools as a function of one string `input` (a regex `format`
enforced on it by grammar), hosted tools the server cannot run dropped and named. Event
loop; pure Python."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.http.api import fields as F

INPUT = "input"   # the one argument a custom tool's call carries: its freeform text
SYNTAXES = ("lark", "regex")


@dataclass
class ResponseTools:
    tools: list[dict[str, Any]] = field(default_factory=list)   # what the template renders
    echo: list[dict[str, Any]] = field(default_factory=list)    # the served tools, as sent
    custom: frozenset[str] = frozenset()   # names of the custom (freeform) tools
    dropped: list[str] = field(default_factory=list)   # "tools[i] (type)" of each dropped one

    def warning(self) -> str | None:
        """What the response's x-pipeserve-warning header says about dropped tools."""
        if not self.dropped:
            return None
        return (f"tools dropped: {', '.join(self.dropped)} (hosted tools this server does not "
                "run; the model sees the function and custom tools only)")


def parse_tools(raw: list[Any], strict: bool) -> ResponseTools:
    """`tools` → ResponseTools. `strict` (server.strict_fields): a tool that would be dropped
    is a 400 naming it instead."""
    out = ResponseTools()
    custom: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind == "function":
            out.tools.append(F.function_tool(tool, where, "tools", flat=True))
            fn = out.tools[-1]["function"]
            out.echo.append({"type": "function", "name": fn["name"],
                             "description": fn.get("description"),
                             "parameters": fn["parameters"], "strict": bool(fn.get("strict"))})
        elif kind == "custom":
            out.tools.append(custom_tool(tool, where))
            # echoed (and stored) with the fields a custom tool has, not what else came with it
            out.echo.append({k: tool[k] for k in ("type", "name", "description")
                             if k in tool})
            if "format" in tool:
                out.echo[-1]["format"] = _format_echo(tool["format"])
            custom.add(tool["name"])
        elif isinstance(kind, str) and kind:
            if strict:
                raise InvalidRequest(
                    f"{where}.type is {kind!r}: a hosted tool this server does not run "
                    "(served: function, custom); with server.strict_fields=false it is dropped "
                    "and named in the x-pipeserve-warning header", param=where)
            out.dropped.append(f"{where} ({kind[:40]})")
        else:
            raise InvalidRequest(f"{where} must be an object with a string type, got "
                                 f"{F.short(tool)}", param="tools")
    names = [t["function"]["name"] for t in out.tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequest(f"tools has more than one tool named {twice[0]!r}", param="tools")
    out.custom = frozenset(custom)
    return out


def custom_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool {name, description, format} → a function of one string argument, `input`.
    A regex format becomes the string's pattern (enforced when the call is); a Lark grammar is
    shown to the model in the argument's description."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.name must be a non-empty string", param="tools")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string", param="tools")
    arg: dict[str, Any] = {"type": "string", "description": "the tool's input, as free text"}
    fmt = tool.get("format")
    if fmt is not None and fmt != {"type": "text"}:
        syntax, definition = _grammar_format(fmt, f"{where}.format")
        if syntax == "regex":   # a JSON schema pattern matches anywhere: anchored, it is the whole
            arg["pattern"] = f"^(?:{definition})$"
        arg["description"] = f"the tool's input, in this {syntax} grammar:\n{definition}"
    fn: dict[str, Any] = {"name": name, "parameters": {
        "type": "object", "properties": {INPUT: arg}, "required": [INPUT],
        "additionalProperties": False}}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _grammar_format(fmt: Any, where: str) -> tuple[str, str]:
    """{"type": "grammar", "syntax": "lark" | "regex", "definition": ...} → (syntax, text)."""
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise InvalidRequest(f"{where} must be {{\"type\": \"text\"}} or {{\"type\": \"grammar\", "
                             f"\"syntax\", \"definition\"}}, got {F.short(fmt, 80)}",
                             param="tools")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in SYNTAXES:
        raise InvalidRequest(f"{where}.syntax is {F.short(syntax)}; allowed: lark, regex",
                             param="tools")
    if not isinstance(definition, str) or not definition.strip():
        raise InvalidRequest(f"{where}.definition must be a non-empty string", param="tools")
    return syntax, definition


def _format_echo(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """A custom tool's format (checked by custom_tool) with the fields a format has."""
    return fmt and {k: fmt[k] for k in ("type", "syntax", "definition") if k in fmt}


def custom_input(arguments: dict[str, Any]) -> str:
    """The freeform text of a custom tool's call (its `input` argument)."""
    value = arguments.get(INPUT)
    return value if isinstance(value, str) else json.dumps(arguments, ensure_ascii=False)
