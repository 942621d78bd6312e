"""Structured-output request fields → one grammar.Constraint: OpenAI `response_format`
(json_object, json_schema), Responses `text.format`, and the extensions `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (every endpoint). A malformed field, or two
constraints in one request, is a 400 naming the field. Event loop; pure Python."""
from __future__ import annotations

from typing import Any

from pipeserve.http.api import fields as F
from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import Constraint

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FORMAT_TYPES = ("text", "json_object", "json_schema")
# the fields each text.format type has: the response repeats these, not what else came with it
# (an unknown field nested past orjson's 254-level writer would end the request in a 500)
FORMAT_FIELDS = {"text": ("type",), "json_object": ("type",),
                 "json_schema": ("type", "name", "schema", "description", "strict")}


def from_body(body: dict[str, Any],
              format_field: str | None = "response_format") -> Constraint | None:
    """The constraint a chat/completions/messages body asks for, or None. `format_field` is
    the OpenAI `response_format` field (None where the protocol has none)."""
    fmt = F.get(body, format_field, dict) if format_field is not None else None
    first = response_format(fmt, format_field) if fmt is not None and format_field else None
    return _one([first] + [_guided(body, name) for name in GUIDED])


def from_text_format(body: dict[str, Any]) -> tuple[Constraint | None, dict[str, Any]]:
    """Responses: `text.format` (flat: {"type": "json_schema", "name", "schema", "strict"})
    plus the guided extensions → (constraint, the format to echo in the response)."""
    text = F.get(body, "text", dict) or {}
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"text.format must be an object, got {F.short(fmt)}",
                             param="text.format")
    kind = fmt.get("type")
    param = "text.format"
    if kind == "json_schema":
        constraint: Constraint | None = _schema(fmt, param, param)
    else:
        constraint = _simple_format(kind, param)
    echo = {k: fmt[k] for k in FORMAT_FIELDS[kind] if k in fmt}
    return _one([constraint] + [_guided(body, name) for name in GUIDED]), echo


def response_format(fmt: dict[str, Any], param: str) -> Constraint | None:
    """OpenAI chat's response_format: {"type": "text" | "json_object"} or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    kind = fmt.get("type")
    if kind != "json_schema":
        return _simple_format(kind, param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f'{param} of type json_schema needs "json_schema": {{"name": ..., '
                             '"schema": {...}}', param=param)
    return _schema(spec, f"{param}.json_schema", param)


def _simple_format(kind: Any, param: str) -> Constraint | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(param)
    raise InvalidRequest(f"{param}.type is {kind!r}; allowed: {', '.join(FORMAT_TYPES)}",
                         param=param)


def _schema(spec: dict[str, Any], where: str, param: str) -> Constraint:
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where}.schema must be a JSON schema object, got "
                             f"{F.short(schema)}", param=param)
    for key, kind, what in (("name", str, "a string"), ("strict", bool, "a boolean"),
                            ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise InvalidRequest(f"{where}.{key} must be {what}", param=param)
    return Constraint.json_schema(F.check_depth(schema, f"{where}.schema", param), param)


def _guided(body: dict[str, Any], name: str) -> Constraint | None:
    value = body.get(name)
    if value is None:
        return None
    if name == "guided_json":
        if isinstance(value, str):
            value = F.json_text(value, name, name)
        if not isinstance(value, dict):
            raise InvalidRequest("guided_json must be a JSON schema object", param=name)
        return Constraint.json_schema(F.check_depth(value, name, name), name)
    if name == "guided_choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, str) and v for v in value)):
            raise InvalidRequest(f"guided_choice must be a non-empty array of non-empty strings, "
                                 f"got {F.short(value)}", param=name)
        return Constraint.choice(value, name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string, got {F.short(value)}",
                             param=name)
    if name == "guided_regex":
        return Constraint.regex(value, name)
    return Constraint.grammar(value, name)


def _one(candidates: list[Constraint | None]) -> Constraint | None:
    found = [c for c in candidates if c is not None]
    if len(found) > 1:
        raise InvalidRequest(f"{found[0].param} and {found[1].param} both constrain the output; "
                             "send one of them", param=found[1].param)
    return found[0] if found else None
