"""Entry codec for the SSD tier: per-layer cache objects ⇄ bytes, with a header hash that is
always checked and per-tensor hashes checked when asked. A layer is stored as its class and its
mlx-lm `state` (without preallocated capacity) and rebuilt by the class's `from_state`.
`encode` reads MLX arrays (engine thread); `decode` builds MLX arrays (engine thread); the
bytes themselves go anywhere."""
from __future__ import annotations

import hashlib
import importlib
import json
from typing import Any

import mlx.core as mx
import numpy as np

from pipeserve.prompt_cache.protocol import content_state

MAGIC = b"PSKV2\n"   # 2: layers stored as their mlx-lm `state` (1 stored their attributes)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CorruptEntry(ValueError):
    """The bytes are not a whole, intact entry (truncated, altered, or another format)."""


class Staged:
    """An entry taken apart on the engine thread (`stage`): its layer description and its
    tensors as evaluated MLX arrays, nothing copied yet. `bytes()` does the host copy and the
    hashing and may run on any thread (the SSD writer), so a snapshot never stalls a step.
    The arrays are immutable values: later writes to the live caches never reach them."""

    __slots__ = ("tokens", "layers", "arrays", "dtypes")

    def __init__(self, tokens: list[int], layers: list[dict[str, Any]], arrays: list[mx.array],
                 dtypes: list[tuple[str, list[int]]]) -> None:
        self.tokens, self.layers, self.arrays, self.dtypes = tokens, layers, arrays, dtypes

    def bytes(self) -> bytes:
        tensors: list[bytes] = []
        meta: list[dict[str, Any]] = []
        for arr, (dtype, shape) in zip(self.arrays, self.dtypes):
            raw = np.ascontiguousarray(np.asarray(arr)).tobytes()
            meta.append({"dtype": dtype, "shape": shape, "nbytes": len(raw),
                         "sha": hashlib.sha256(raw).hexdigest()})
            tensors.append(raw)
        header = json.dumps({"tokens": list(self.tokens), "layers": self.layers,
                             "tensors": meta}).encode()
        return b"".join([MAGIC, len(header).to_bytes(8, "little"), header,
                         hashlib.sha256(header).digest(), *tensors])


def encode(tokens: list[int], caches: list[Any]) -> bytes:
    return stage(tokens, caches).bytes()


def stage(tokens: list[int], caches: list[Any]) -> Staged:
    """Engine thread: describe the entry and evaluate its tensors (as unsigned views of their
    bits), without copying them to the host."""
    # layouts whose caches point into a shared pool (kv=paged) store a plain copy
    caches = [c.portable() if hasattr(c, "portable") else c for c in caches]
    arrays: list[mx.array] = []
    dtypes: list[tuple[str, list[int]]] = []

    def put(arr: mx.array) -> dict[str, int]:
        arrays.append(arr.view(_mx_uint(arr.dtype.size)) if arr.dtype.size in _UINT else arr)
        dtypes.append((str(arr.dtype).removeprefix("mlx.core."), list(arr.shape)))
        return {"t": len(arrays) - 1}

    def value(v: Any) -> Any:
        if isinstance(v, mx.array):
            return put(v)
        if isinstance(v, (list, tuple)):
            return {"seq": [value(x) for x in v], "tuple": isinstance(v, tuple)}
        if v is None or isinstance(v, (int, float, str, bool)):
            return {"v": v}
        raise TypeError(f"cannot store {type(v).__name__} in a prompt-cache entry")

    layers = [{"class": f"{type(c).__module__}:{type(c).__qualname__}",
               "state": value(content_state(c))} for c in caches]
    arrays = [mx.contiguous(a) for a in arrays]
    mx.eval(arrays)
    return Staged(list(tokens), layers, arrays, dtypes)


def decode(blob: bytes, verify: bool) -> tuple[list[int], list[Any]]:
    """Bytes → (tokens, per-layer caches). Raises CorruptEntry on any mismatch."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise CorruptEntry("bad magic")
    pos = len(MAGIC)
    n = int.from_bytes(blob[pos:pos + 8], "little")
    pos += 8
    header = blob[pos:pos + n]
    digest = blob[pos + n:pos + n + 32]
    if len(header) != n or hashlib.sha256(header).digest() != digest:
        raise CorruptEntry("header hash mismatch")
    pos += n + 32
    try:
        meta = json.loads(header)
    except ValueError as e:
        raise CorruptEntry(f"header is not JSON: {e}") from e
    arrays: list[mx.array] = []
    for t in meta["tensors"]:
        raw = blob[pos:pos + t["nbytes"]]
        pos += t["nbytes"]
        if len(raw) != t["nbytes"]:
            raise CorruptEntry("truncated tensor data")
        if verify and hashlib.sha256(raw).hexdigest() != t["sha"]:
            raise CorruptEntry("tensor hash mismatch")
        dtype = getattr(mx, t["dtype"])
        host = np.frombuffer(raw, dtype=_UINT[dtype.size]).reshape(t["shape"])
        arrays.append(mx.array(host).view(dtype))
    if pos != len(blob):
        raise CorruptEntry("trailing bytes")

    def value(v: dict[str, Any]) -> Any:
        if "t" in v:
            return arrays[v["t"]]
        if "seq" in v:
            items = [value(x) for x in v["seq"]]
            return tuple(items) if v["tuple"] else items
        return v["v"]

    caches = []
    for i, layer in enumerate(meta["layers"]):
        try:   # a state this version's class cannot take (another format) is not an entry
            module, _, name = layer["class"].partition(":")
            cls = getattr(importlib.import_module(module), name)
            caches.append(cls.from_state(value(layer["state"])))
        except (KeyError, TypeError, ValueError, AttributeError, ImportError) as e:
            raise CorruptEntry(f"layer {i} cannot be rebuilt: {e!r}") from e
    return meta["tokens"], caches


def _mx_uint(size: int) -> mx.Dtype:
    return {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[size]
