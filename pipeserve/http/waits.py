"""Waiting on the event loop for something another thread signals (a threading.Event: a cache
flush, a pool child's reply) without holding a thread of a shared executor while it waits: a
slow flush must never starve /metrics, grammar compiles or model loads of threads."""
from __future__ import annotations

import asyncio
import threading
import time


async def wait_event(event: threading.Event, timeout_s: float) -> bool:
    """True once `event` is set, False after `timeout_s`. Polls from 1 ms up to 50 ms apart:
    a quick answer is seen at once, a long wait costs the loop ~20 checks a second."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True
