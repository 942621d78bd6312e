"""Waiting on the event loop for the engine to write its prompt cache out (POST
/admin/cache/flush, the shutdown) without holding a thread of a shared executor while it waits:
a slow flush must never starve /metrics, grammar compiles or model loads of threads."""
from __future__ import annotations

from typing import Any

from pipeserve.core.client import reply_of
from pipeserve.core.events import Flush
from pipeserve.errors import ServeError


async def flushed(engine: Any, timeout_s: float) -> bool:
    """True once every dirty prompt-cache entry is on disk; False when the engine could not
    say so within `timeout_s` (stopped, dead, or still writing)."""
    try:
        return bool(await reply_of(engine.command(Flush()), timeout_s, "flush the prompt cache"))
    except ServeError:
        return False
