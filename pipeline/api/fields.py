"""Typed access to JSON request fields with 400s that name the field, the value and the rule.
Event loop; pure Python."""
from __future__ import annotations

from typing import Any

from pipeline.errors import InvalidRequest

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias[{key}] must be a number in [-100, 100], got "
                                 f"{_short(bias)}", param="logit_bias")
        out[token] = float(bias)
    return out
