"""pipeserve/http/api/json_body.py: the chunked parser (bodies of many values) gives what orjson gives,
and refuses what orjson refuses (trailing data, truncation, nesting past 1024 levels). No model."""
from __future__ import annotations

import json

import orjson
import pytest

from pipeserve.http.api import json_body
from pipeserve.http.api.json_body import JSONError, MANY_VALUES


def many(n: int) -> bytes:
    return json.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"é {i}", "n": i, "f": i / 3, "ok": i % 2 == 0, "x": None}
        for i in range(n)]}, ensure_ascii=False).encode()


def test_the_chunked_path_equals_orjson() -> None:
    data = many(MANY_VALUES)   # past the threshold: parsed in chunks
    assert data.count(b",") > MANY_VALUES
    value = json_body.loads(data)
    assert value == orjson.loads(data)
    assert type(value["messages"][1]["f"]) is float and type(value["messages"][1]["n"]) is int
    assert json_body.loads(data.decode()) == value   # JSON inside a string field, as text


@pytest.mark.parametrize("tail, message", [(b" [1]", "trailing"), (b"}", "trailing")])
def test_trailing_data_is_refused(tail: bytes, message: str) -> None:
    with pytest.raises(JSONError, match=message):
        json_body.loads(many(MANY_VALUES) + tail)


def test_truncated_and_empty_documents_are_refused() -> None:
    data = many(MANY_VALUES)
    with pytest.raises(JSONError):
        json_body.loads(data[: len(data) // 2])
    with pytest.raises(JSONError):
        json_body.loads(b"")


def test_nesting_past_1024_levels_is_refused_on_both_paths() -> None:
    commas = b"[" + b"1," * MANY_VALUES + b"1]"
    deep = b"[" * 1100 + commas + b"]" * 1100
    with pytest.raises(JSONError, match="depth"):
        json_body.loads(deep)               # chunked
    with pytest.raises(JSONError):
        json_body.loads(b"[" * 1100 + b"]" * 1100)   # orjson
    ok = b"[" * 500 + commas + b"]" * 500   # (== on deeper lists recurses past Python's limit)
    assert json_body.loads(ok) == orjson.loads(ok)
