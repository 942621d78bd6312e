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
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    async def next(self) -> Event:
        event = await self._queue.get()
        if isinstance(event, (Finished, Failed)):
            self.finished = True
        return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()
