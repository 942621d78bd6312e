"""JSON request bodies (and JSON sent inside string fields, such as tool-call arguments) parsed
so that a large one never holds the GIL for long: orjson builds a whole document in one C call,
which for 300k small objects is a few hundred milliseconds the event loop cannot run. A document
with many values is parsed instead by ijson's C backend fed in small chunks through a Python
`read`, so the interpreter can switch threads between chunks. Any thread; called from the
preparation pool for large inputs (pipeserve/eventloop/offload.py, which also pauses the cyclic GC)."""
from __future__ import annotations

from typing import Any

import ijson
import orjson

# Past this many ',' bytes (about one per value; commas inside strings count too: they only
# pick the slower path) a document is parsed in chunks. Below it orjson takes well under 10 ms.
MANY_VALUES = 20_000
CHUNK_BYTES = 16 * 1024   # bytes per C call of the chunked parser (~1 ms of work)


class JSONError(ValueError):
    """Not valid JSON; the text says where (orjson's or ijson's message)."""


def loads(data: bytes | str) -> Any:
    """The JSON value of `data`, as orjson.loads returns it (floats as float, ints as int)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b",") <= MANY_VALUES:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise JSONError(str(e)) from None
    return _chunked(raw)


def _chunked(raw: bytes) -> Any:
    reader = _Reader(raw)
    try:
        values = ijson.items(reader, "", use_float=True, buf_size=CHUNK_BYTES)
        value = next(values)
        for _ in values:   # a second top-level value: not one JSON document
            raise JSONError("trailing data after the JSON document")
    except StopIteration:
        raise JSONError("the document is empty") from None
    except ijson.JSONError as e:
        raise JSONError((str(e).strip().splitlines() or [type(e).__name__])[0]) from None
    except RecursionError:
        raise JSONError("nested too deeply to parse") from None
    _check_depth(value)
    return value


MAX_DEPTH = 1024   # orjson's limit: the small path refuses deeper documents, so this one does


def _check_depth(value: Any) -> None:
    """As orjson: a document nested past MAX_DEPTH is not parsed (iterative; Python steps, so
    the loop may run between them)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise JSONError(f"exceeds the maximum depth of {MAX_DEPTH} (nested too deeply)")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))


class _Reader:
    """A file over `raw` whose `read` is Python code: each call is a point where the
    interpreter may hand the GIL to another thread (the event loop)."""

    __slots__ = ("_view", "_pos")

    def __init__(self, raw: bytes) -> None:
        self._view, self._pos = memoryview(raw), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos:end])
        self._pos = min(end, len(self._view))
        return chunk
