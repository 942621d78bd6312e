"""RequestStream: the event loop's end of one request's event channel.
`post` may be called from any thread; iteration happens on the event loop."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from pipeserve.core.events import Event, Failed, Finished


class RequestStream:
    """A deque and at most one waiting future, not an asyncio.Queue: a streamed token costs
    one append and, when the consumer is waiting, one future; `wait` arms one timer, where
    `asyncio.wait_for(queue.get(), t)` built a task, a future and a timer per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False

    def post(self, event: Event) -> None:
        """Thread-safe: hand an event to the loop. Safe after the loop has closed."""
        post_many([(self, event)])

    def _put(self, event: Event) -> None:   # event loop
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def pending(self) -> bool:
        """Whether an event is here already (the next `wait` returns at once)."""
        return bool(self._events)

    def poll(self) -> Event | None:
        """The next event if one is already here, else None (no await, no timer: the common
        case while the engine outpaces the stream's consumer)."""
        if not self._events:
            return None
        event = self._events.popleft()
        if isinstance(event, (Finished, Failed)):
            self.finished = True
        return event

    async def wait(self, timeout: float | None) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one (a keep-alive)."""
        if not self._events:
            waiter = self._waiter = self._loop.create_future()
            timer = (self._loop.call_later(timeout, _expire, waiter)
                     if timeout is not None else None)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self.poll()

    async def next(self) -> Event:
        while True:
            event = await self.wait(None)
            if event is not None:
                return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _deliver(items: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in items:
        stream._put(event)


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
