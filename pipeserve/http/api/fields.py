"""Typed access to JSON request fields with 400s that name the field, the value and the rule.
Event loop; pure Python."""
from __future__ import annotations

import reprlib
from typing import Any


from pipeserve.errors import InvalidRequest, NotFound
from pipeserve.adapters.lora import NONE
from pipeserve.http.api import json_body

# Nesting of arrays and objects a JSON schema, tool-call arguments or metadata may have. Far
# past any real schema (OpenAI's strict mode allows 10 levels of objects), and far below what
# the recursive code that handles them (the chat template's tojson, the grammar compiler,
# orjson's 255-level writer) can take.
MAX_DEPTH = 64

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def short(value: Any, limit: int = 60) -> str:
    """A value as a client sent it, cut to fit an error message. Bounded work: a 5 MB list is
    never written out in full (repr of it would hold the GIL for as long as it takes)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_short = short


def get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
        *, nullable: bool = True) -> Any:
    """body[name] checked against `kind`; ints are accepted where floats are; bools never
    pass as numbers. Missing or null → default."""
    value = body.get(name)
    if value is None:
        if name in body and not nullable:
            raise InvalidRequest(f"{name} must not be null", param=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(_matches(value, k) for k in kinds)
    if not ok:
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise InvalidRequest(f"{name} must be {want}, got {_short(value)}", param=name)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _matches(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def check_depth(value: Any, where: str, param: str, limit: int = MAX_DEPTH) -> Any:
    """`value` (returned) unless its arrays/objects nest deeper than `limit`: a 400 naming
    the field. Iterative, so it never recurses itself."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        if depth > limit:
            raise InvalidRequest(f"{where} nests arrays/objects deeper than {limit} levels, "
                                 f"the limit", param=param)
        stack.extend((child, depth + 1) for child in children)
    return value


def json_text(text: str, where: str, param: str) -> Any:
    """A JSON document sent as a string (tool-call arguments, a schema): parsed (orjson: a
    document nested past its limit is an error, not a RecursionError) and depth-checked."""
    try:
        value = json_body.loads(text)
    except json_body.JSONError as e:
        if "depth" in str(e) or "deeply" in str(e):   # orjson stops at 1024 levels
            raise InvalidRequest(f"{where} nests arrays/objects deeper than {MAX_DEPTH} "
                                 "levels, the limit", param=param) from None
        raise InvalidRequest(f"{where} is not valid JSON: {e}", param=param) from None
    return check_depth(value, where, param)


def token_ids(value: Any) -> bool:
    """A non-empty array of integer token ids (bools are not ids). A JSON body's ids are all
    exact ints: one pass of `type` in C answers for them (a 16k-token prompt in a quarter of a
    millisecond, not one); anything else takes the element-by-element check."""
    if not isinstance(value, list) or not value:
        return False
    if set(map(type, value)) == {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def seed(body: dict[str, Any]) -> int | None:
    """`seed`: an unsigned 64-bit integer. JSON integers past 2^64 arrive as floats."""
    value = body.get("seed")
    if isinstance(value, float) and value.is_integer():
        raise InvalidRequest(f"seed is {value:.0f}; allowed range is [0, {(1 << 64) - 1}] "
                             "(an unsigned 64-bit integer)", param="seed")
    return get(body, "seed", int)


def stop_list(body: dict[str, Any], name: str = "stop") -> list[str]:
    value = get(body, name, (str, list))
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise InvalidRequest(f"{name}[{i}] must be a string, got {_short(s)}", param=name)
    return list(value)


LOGIT_BIAS_LIMIT = 100.0


def logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    value = get(body, "logit_bias", dict)
    if value is None:
        return None
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {_short(key)}",
                                 param="logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequest(f"logit_bias[{key}] must be a number, got {_short(bias)}",
                                 param="logit_bias")
        # OpenAI documents [-100, 100]; like vLLM, values past it (benchmark clients send
        # -1e9 to ban a token) are clamped, since ±100 already bans or forces the token
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    return out


def function_tool(tool: Any, where: str, param: str, *, flat: bool = False) -> dict[str, Any]:
    """A function tool → OpenAI's nested shape {"type": "function", "function": {name,
    description, parameters}}, the one chat templates render. `flat`: Responses' shape."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object, got {_short(tool)}", param=param)
    kind = tool.get("type", "function")
    if kind != "function":
        raise InvalidRequest(f"{where}.type is {kind!r}; only 'function' tools are supported",
                             param=param)
    fn = tool if flat else tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        field = "name" if flat else "function.name"
        raise InvalidRequest(f"{where}.{field} must be a non-empty string", param=param)
    return {"type": "function", "function": _function_spec(fn, "parameters", where, param)}


def _function_spec(fn: dict[str, Any], schema_key: str, where: str, param: str) -> dict[str, Any]:
    schema = fn.get(schema_key)
    if schema is not None and not isinstance(schema, dict):
        raise InvalidRequest(f"{where}.{schema_key} must be a JSON schema object, got "
                             f"{_short(schema)}", param=param)
    check_depth(schema, f"{where}.{schema_key}", param)
    out: dict[str, Any] = {"name": fn["name"],
                           "parameters": schema or {"type": "object", "properties": {}}}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.strict must be a boolean, got {_short(strict)}", param=param)
    if strict:
        out["strict"] = True   # the arguments are generated under the schema, extra keys refused
    return out


def anthropic_tool(tool: Any, where: str, param: str) -> dict[str, Any]:
    """An Anthropic tool {name, description, input_schema} → OpenAI's nested shape."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequest(f"{where}.name must be a non-empty string", param=param)
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest(f"{where}.type is {tool['type']!r}; only client tools with an "
                             "input_schema are supported", param=param)
    return {"type": "function", "function": _function_spec(tool, "input_schema", where, param)}


def tool_choice(choice: str, name: str | None, tools: list[dict[str, Any]],
                param: str) -> tuple[str, str | None]:
    """Check a normalised tool choice (auto | none | required | named) against the tools."""
    if choice in ("required", "named") and not tools:
        raise InvalidRequest(f"{param} asks for a tool call but the request has no tools",
                             param=param)
    names = [t["function"]["name"] for t in tools]
    if choice == "named" and name not in names:
        raise InvalidRequest(f"{param} names tool {name!r}, which is not among the request's "
                             f"tools ({', '.join(names)})", param=param)
    return choice, name


BASE_TAG = "latest"


def adapter(body: dict[str, Any], base: str, mounted: Any) -> str | None:
    """The adapter a request picks, as Request.adapter holds it: the `adapter` field (an id,
    an array of ids stacked, or "none" for the base model) or an OpenAI `model` of
    "<base>:<id>" (vLLM-style; "<base>:latest" is the base model, as Ollama's tag); None
    when it names none, or names the launch default. `mounted` is the model's AdapterSet (or
    None: no adapters). An id that is not mounted is a 404 naming the field and the ids."""
    value = body.get("adapter")
    if isinstance(value, list):   # a stack: the adapters' deltas add up on every row
        if mounted is None:
            raise NotFound(f"adapter stacks {value!r}, but no adapter is mounted (launch with "
                           "model.adapter_dir and model.adapters)", param="adapter",
                           code="adapter_not_found")
        return mounted.canonical(value, "adapter")
    choice, param = get(body, "adapter", str), "adapter"
    model = body.get("model")
    if choice is None and isinstance(model, str) and model.startswith(base + ":"):
        choice, param = model[len(base) + 1:], "model"
        if choice == BASE_TAG:   # Ollama's default tag: `smollm2:latest` is the model itself
            return None
    if choice is None:
        return None
    if mounted is None:
        if choice == NONE:
            return None
        raise NotFound(f"{param} names adapter {choice!r}, which is not mounted; mounted: none "
                       "(launch with model.adapter_dir and model.adapters)", param=param,
                       code="adapter_not_found")
    return mounted.canonical(choice, param)


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive(body: dict[str, Any]) -> float | None:
    """`keep_alive` (Ollama's): how long the model stays loaded after this request — seconds
    as a number, or a duration string ("30s", "5m", "1h"); negative: until unloaded by hand;
    0: unload once it is done. None when absent."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        for unit in sorted(_DURATION_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                number, scale = text[:-len(unit)], _DURATION_UNITS[unit]
                break
        else:
            number, scale = text, 1.0
        try:
            return float(number) * scale
        except ValueError:
            pass
    raise InvalidRequest(f"keep_alive must be seconds (a number; negative: keep loaded) or a "
                         f"duration such as \"5m\", got {short(value)}", param="keep_alive")


def reasoning_budget(body: dict[str, Any]) -> int | None:
    """The extension `max_reasoning_tokens` (every chat endpoint): at most this many thinking
    tokens, then the end-of-thinking marker is forced and the answer follows."""
    value = get(body, "max_reasoning_tokens", int)
    if value is not None and value < 1:
        raise InvalidRequest(f"max_reasoning_tokens is {value}; it must be at least 1 (send "
                             "reasoning_effort 'none' to turn thinking off)",
                             param="max_reasoning_tokens")
    return value
