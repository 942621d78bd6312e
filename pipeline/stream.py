"""RequestStream: the event loop's end of one request's event channel.
`post` may be called from any thread; iteration happens on the event loop."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pipeline.events import Event, Failed, Finished


class RequestStream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    def post(self, event: Event) -> None:
        """Thread-safe: hand an event to the loop. Safe after the loop has closed."""
        post_many([(self, event)])

    async def next(self) -> Event:
        event = await self._queue.get()
        if isinstance(event, (Finished, Failed)):
            self.finished = True
        return event

    def poll(self) -> Event | None:
        """The next event if one is already here, else None (no await, no timer: the common
        case while the engine outpaces the stream's consumer)."""
        try:
            event = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(event, (Finished, Failed)):
            self.finished = True
        return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()


def _deliver(items: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in items:
        stream._queue.put_nowait(event)


def post_many(items: list[tuple[RequestStream, Event]]) -> None:
    """Thread-safe: deliver a step's events with one loop wake-up per event loop (a wake-up
    writes to the loop's self-pipe: per event it would cost a syscall per token)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Event]]] = {}
    for stream, event in items:
        by_loop.setdefault(stream._loop, []).append((stream, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more
