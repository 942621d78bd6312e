"""Request preparation that is too large for the event loop (JSON bodies, chat templates,
tokenization: Hugging Face tokenizers and Jinja, never MLX) runs on a small bounded thread pool;
small inputs stay inline, so they never queue behind a large one. Called from the event loop."""
from __future__ import annotations

import asyncio
import functools
import gc
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pipeserve.errors import AdmissionRejected

T = TypeVar("T")

# Past this many bytes (or characters) of client input, preparing a request moves off the loop.
# Below it the work is well under a millisecond, less than the hop to a thread and back.
INLINE_LIMIT = 32 * 1024
# Two threads: a second large request need not wait for the first, and the GIL-bound parts of
# template rendering never get more than two threads contending with the event loop.
POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")


async def off_loop(size: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, inline when `size` (bytes or characters of input) is small, else on POOL
    (past PAUSE_GC_BYTES with the cyclic GC paused, see gc_paused). Exceptions (InvalidRequest
    included) propagate to the awaiting handler as they would inline."""
    if size <= INLINE_LIMIT:
        return fn(*args)
    call = functools.partial(_paused_call if size > PAUSE_GC_BYTES else _call, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(POOL, call)


class MediaPool:
    """Media preparation (fetch, decode, the image/video/audio processors) on threads of its
    own, so a request's text preparation never queues behind another's media; at most
    `workers` run and `max_queue` wait, more are refused (429). A request counts until its
    thread finishes, even when its client has gone."""

    def __init__(self, workers: int, max_queue: int) -> None:
        self.workers, self.max_queue = workers, max_queue
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media")
        self.pending = 0   # event loop only

    async def run(self, fn: Callable[..., T], *args: object) -> T:

        if self.pending >= self.workers + self.max_queue:
            raise AdmissionRejected(
                f"{self.pending} requests with media are being prepared or waiting; the limit is "
                f"{self.workers} running + {self.max_queue} waiting (media.media_workers, "
                "media.max_media_queue); retry after Retry-After seconds", retry_after_s=2,
                code="media_queue_full")
        self.pending += 1
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(_media_call, fn, *args))
        future.add_done_callback(self._done)
        return await future

    def _done(self, _: object) -> None:
        self.pending -= 1


def _media_call(fn: Callable[..., T], *args: object) -> T:
    """`fn` with the GC paused; then the C heap's free pages go back to the system (decoded
    images are large; glibc keeps freed arenas of worker threads otherwise). A refusal's
    traceback lets go of its frames' locals first (a half-read image, its chunks), so they are
    freed now rather than at the next collection."""
    try:
        return _paused_call(fn, *args)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        _trim()


def _trim() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    """glibc, for malloc_trim (None elsewhere: macOS, musl)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC: Any = _libc()


def _call(fn: Callable[..., T], *args: object) -> T:
    return fn(*args)


def _paused_call(fn: Callable[..., T], *args: object) -> T:
    with gc_paused():
        return fn(*args)


# -- the cyclic GC during large inputs -------------------------------------------------------
# Parsing, validating and rendering a body of 300k objects allocates millions of containers;
# every few hundred thousand the cyclic GC runs a full collection that walks all of them in one
# C call (hundreds of milliseconds holding the GIL, so the event loop cannot run). While large
# inputs are being prepared the automatic GC is off; it comes back RESUME_GC_S after the last
# one finished (one preparation's steps run back to back: no collection between them). Their
# values are acyclic, so reference counting frees them meanwhile; only other code's cycles wait.
PAUSE_GC_BYTES = 1_000_000
RESUME_GC_S = 0.5
_gc_lock = threading.Lock()
_gc_users = 0
_gc_was_enabled = True
_gc_timer: threading.Timer | None = None


class gc_paused:
    def __enter__(self) -> None:
        global _gc_users, _gc_was_enabled, _gc_timer
        with _gc_lock:
            if _gc_timer is not None:   # a resume was pending: it stays off, as it is
                _gc_timer.cancel()
                _gc_timer = None
            elif _gc_users == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_users += 1

    def __exit__(self, *exc: object) -> None:
        global _gc_users, _gc_timer
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0:
                _gc_timer = threading.Timer(RESUME_GC_S, _resume_gc)
                _gc_timer.daemon = True
                _gc_timer.start()


def _resume_gc() -> None:
    global _gc_timer
    with _gc_lock:
        if _gc_users == 0 and _gc_timer is not None:
            _gc_timer = None
            if _gc_was_enabled:
                gc.enable()
