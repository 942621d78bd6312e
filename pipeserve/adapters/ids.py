"""What an adapter id may be, and the ids a request names: no mlx, so the config check reads it
(pipeserve/model/config.py) before anything loads; lora.py mounts what it names."""
from __future__ import annotations

from pipeserve.errors import ConfigError

NONE = "none"   # the request field's value for the base model, no adapter
STACK = "+"   # Request.adapter of a stack: its ids joined, in the request's order
MAX_ID_BYTES = 255   # NAME_MAX of Linux and macOS file systems: one path component


def check_id(adapter_id: str) -> None:
    """An id names one subdirectory of model.adapter_dir, nothing else ('+' joins the ids of
    a stack, so no id holds one), and fits in one file name (MAX_ID_BYTES)."""
    size = len(adapter_id.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        raise ConfigError(
            f"model.adapter '{adapter_id[:40]}…' is {size} bytes long; an adapter id is the "
            f"name of one subdirectory of model.adapter_dir, at most {MAX_ID_BYTES} bytes "
            "(a file name's limit)")
    if (not adapter_id or adapter_id in (".", "..") or ".." in adapter_id
            or any(c in adapter_id for c in "/\\\0" + STACK)):
        raise ConfigError(
            f"model.adapter '{adapter_id}' is not an adapter id: an id is the name of one "
            "subdirectory of model.adapter_dir, without '/', '\\', '+' or '..'")
