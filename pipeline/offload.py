"""Request preparation that is too large for the event loop (JSON bodies, chat templates,
tokenization: Hugging Face tokenizers and Jinja, never MLX) runs on a small bounded thread pool;
small inputs stay inline, so they never queue behind a large one. Called from the event loop."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Past this many bytes (or characters) of client input, preparing a request moves off the loop.
# Below it the work is well under a millisecond, less than the hop to a thread and back.
INLINE_LIMIT = 32 * 1024
# Two threads: a second large request need not wait for the first, and the GIL-bound parts of
# template rendering never get more than two threads contending with the event loop.
POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")


async def off_loop(size: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, inline when `size` (bytes or characters of input) is small, else on POOL.
    Exceptions (InvalidRequest included) propagate to the awaiting handler as they would inline."""
    if size <= INLINE_LIMIT:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(POOL, functools.partial(fn, *args))
