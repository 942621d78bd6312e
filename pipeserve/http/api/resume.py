"""Resumable SSE streams: every frame of a generation stream is numbered (`id: N`) and kept in
a StreamLog for server.stream_resume_s after the request ends, so GET /v1/streams/{id} with
Last-Event-ID (or ?after=N) replays what a client missed and follows the rest live. The frames
are produced by a task of their own; connections only read the log. Event loop."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import sanic

from pipeserve.http.api.http import SSE_HEADERS
from pipeserve.errors import InvalidRequest, NotFound

log = logging.getLogger("pipeserve")
T = TypeVar("T")
KEEP_ALIVE = b": keep-alive\n\n"
REPORT_BYTES = 1 << 16   # the bytes gauge moves in steps of this (and at every stream's end)


def resumable(body: dict[str, Any]) -> bool:
    """`stream_options.resumable` of any protocol's body (an extension field): when true, a
    disconnect leaves the generation running for server.stream_resume_s."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequest(f"stream_options must be an object, got {type(opts).__name__}",
                             param="stream_options")
    value = opts.get("resumable", False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"stream_options.resumable must be a boolean, got {value!r:.40}",
                             param="stream_options")
    return value


class StreamLog:
    """The numbered frames of one stream. `frames[i]` is frame `first + i` (frames before
    `first` were dropped to keep the store under its byte cap, only once every connected
    reader had sent them). `append` and `end` wake every reader; `put` hands a frame straight
    to the primary connection (the request's own) when it has sent everything before it, so
    the common case costs no wake-up of that connection's task per frame."""

    def __init__(self, store: StreamStore, stream_id: str, resumable: bool) -> None:
        self.store, self.stream_id, self.resumable = store, stream_id, resumable
        self.frames: list[bytes] = []
        self.first = 0
        self.nbytes = 0
        self.ended = False
        self.cancelled = False   # ended because its client left (not resumable)
        self.background = False   # runs to its end without readers (a background response)
        self.ended_at = 0.0
        self.readers: dict[int, int] = {}   # reader token → next frame it will send
        self.task: asyncio.Task[Any] | None = None   # the producer
        self._waiters: dict[int, asyncio.Future[bool]] = {}   # reader token → its wait
        self._primary: tuple[int, Any] | None = None   # (token, response) of the request's own
        self._sending = False   # a write to the primary connection is in progress
        self.body_ended = False   # the primary connection's response body was ended by put_many
        self._orphan_timer: asyncio.TimerHandle | None = None
        self._next_reader = 0

    @property
    def num_frames(self) -> int:
        return self.first + len(self.frames)

    def append(self, frame: bytes) -> None:
        """One SSE event (`data: ...\\n\\n` or `event: ...\\ndata: ...\\n\\n`), numbered here."""
        framed = b"id: %d\n" % self.num_frames + frame
        self.frames.append(framed)
        self.nbytes += len(framed)
        self.store.grew(len(framed))
        self._wake()

    async def put(self, frame: bytes) -> None:
        """`append`, sending it to the primary connection here when that one is caught up
        (and so waiting for it; the producer then feels the connection's back-pressure)."""
        await self.put_many((frame,))

    async def put_many(self, frames: tuple[bytes, ...] | list[bytes], last: bool = False) -> None:
        """`put` of several frames, numbered one by one, sent to the primary connection in
        one write (the same bytes as one write per frame, a syscall instead of several).
        `last`: no frame follows, so that write also ends the response's body."""
        primary = self._primary
        if primary is None:
            for frame in frames:
                self.append(frame)
            return
        token, response = primary
        ready = not self._sending and self.readers.get(token) == self.num_frames
        at = self.num_frames
        framed = [b"id: %d\n" % (at + k) + frame for k, frame in enumerate(frames)]
        self.frames.extend(framed)
        size = sum(map(len, framed))
        self.nbytes += size
        self.store.grew(size)
        self._wake(skip=token if ready else None)
        if not ready:
            return
        self.readers[token] = self.num_frames
        self._sending = True
        try:
            data = framed[0] if len(framed) == 1 else b"".join(framed)
            if last:
                self.body_ended = True   # before the write: a failed one must not be ended again
                await response.send(data, end_stream=True)
            else:
                await response.send(data)
        except BaseException:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise   # this producer is being cancelled (a plain stream's client left)
            # the connection failed under the write (Sanic may cancel what waits on a lost
            # transport): the stream goes on; the connection's own task settles the client
            self._primary = None
            self._wake()
        finally:
            self._sending = False

    def end(self, cancelled: bool = False) -> None:
        if self.ended:
            return
        self.ended, self.cancelled = True, cancelled
        self.ended_at = asyncio.get_running_loop().time()
        self._disarm()
        self.store.ended(self)
        self._wake()

    def _wake(self, skip: int | None = None) -> None:
        for token in [t for t in self._waiters if t != skip]:
            w = self._waiters.pop(token)
            if not w.done():
                w.set_result(False)

    def trim_sent(self) -> int:
        """Drop frames every connected reader has sent; the bytes freed."""
        if not self.readers:
            return 0
        upto = min(min(self.readers.values()), self.num_frames) - self.first
        if upto <= 0:
            return 0
        freed = sum(len(f) for f in self.frames[:upto])
        del self.frames[:upto]
        self.first += upto
        self.nbytes -= freed
        return freed

    # -- readers ---------------------------------------------------------------------------
    async def follow(self, response: Any, after: int, keep_alive_s: float,
                     primary: bool = False) -> None:
        """Send the frames after `after` to `response`, then the rest as they come, until the
        stream ends; a keep-alive comment every `keep_alive_s` without a frame. The primary
        connection also takes frames from `put` directly."""
        token = self._next_reader
        self._next_reader += 1
        self.readers[token] = min(after + 1, self.num_frames)   # never past what exists
        if primary:
            self._primary = (token, response)
        self._disarm()
        loop = asyncio.get_running_loop()
        try:
            while True:
                at = self.readers[token]   # >= first: trim_sent keeps what a reader lacks
                if at < self.num_frames and not (primary and self._sending):
                    chunk = b"".join(self.frames[at - self.first:])
                    self.readers[token] = self.num_frames
                    await self._send(response, chunk, primary)
                    continue
                if self.ended and at >= self.num_frames:
                    return
                waiter = self._waiters[token] = loop.create_future()
                timer = loop.call_later(keep_alive_s, _expire, waiter)
                try:
                    timed_out = await waiter
                finally:
                    timer.cancel()
                    self._waiters.pop(token, None)
                if timed_out and not (primary and self._sending) \
                        and self.readers[token] == self.num_frames and not self.ended:
                    await self._send(response, KEEP_ALIVE, primary)
        finally:
            del self.readers[token]
            if self._primary is not None and self._primary[0] == token:
                self._primary = None
            if not self.readers and not self.ended:
                self._arm()

    async def _send(self, response: Any, data: bytes, primary: bool) -> None:
        if not primary:
            await response.send(data)
            return
        self._sending = True
        try:
            await response.send(data)
        finally:
            self._sending = False   # frames that came meanwhile: the loop sends them next

    def _arm(self) -> None:
        """Nobody reads a live stream: a resumable one runs on for stream_resume_s, then its
        generation is cancelled; any other is cancelled now."""
        if self.background:   # only its own cancel stops it
            return
        if not self.resumable:
            self.cancel()
            return
        self._disarm()
        self._orphan_timer = asyncio.get_running_loop().call_later(
            self.store.resume_s, self.cancel)

    def _disarm(self) -> None:
        if self._orphan_timer is not None:
            self._orphan_timer.cancel()
            self._orphan_timer = None

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(True)   # timed out (a wake-up by a frame or the end is False)


class Frames:
    """A stream's frames not yet handed to its log: `flush_unless_ready` writes them unless
    `gen` (one choice's generation: anything with the RequestStream `stream` it reads) already
    holds its next event, whose frames then join them in the same write. With several
    choices (`gen` None) every delta is flushed."""

    def __init__(self, log: StreamLog, gen: Any) -> None:
        self.log, self.gen = log, gen
        self.pending: list[bytes] = []
        self.add = self.pending.append

    async def flush_unless_ready(self) -> None:
        if self.gen is None or not self.gen.stream.pending:
            await self.flush()

    async def flush(self, last: bool = False) -> None:
        """`last`: the stream's final frames, whose write also ends the response body."""
        if self.pending:
            frames = tuple(self.pending)
            self.pending.clear()
            await self.log.put_many(frames, last)


class StreamStore:
    """Every live stream's log and every ended one for `resume_s`, under `cap_bytes` (ended
    logs are dropped oldest first, then frames every reader has sent). Counted in metrics."""

    def __init__(self, resume_s: float, cap_bytes: int, metrics: Any) -> None:
        self.resume_s, self.cap_bytes, self.metrics = resume_s, cap_bytes, metrics
        self.logs: dict[str, StreamLog] = {}
        self.nbytes = 0
        self._reported = 0   # nbytes as the gauge last showed it

    def open(self, stream_id: str, resumable: bool) -> StreamLog:
        stream = StreamLog(self, stream_id, resumable)
        self.logs[stream_id] = stream
        self.metrics.stream_logs.set(len(self.logs))
        return stream

    def get(self, stream_id: str) -> StreamLog:
        stream = self.logs.get(stream_id)
        if stream is None or stream.cancelled:
            self.metrics.stream_resumes.labels("not_found").inc()
            why = ("it was cancelled when its client disconnected (send stream_options."
                   "resumable: true to keep a stream running without its client)"
                   if stream is not None else
                   f"streams are kept for server.stream_resume_s ({self.resume_s:g} s) after "
                   "they end")
            raise NotFound(f"stream {stream_id!r} is unknown or expired: {why}",
                           param="stream_id", code="stream_not_found")
        return stream

    def grew(self, n: int) -> None:
        self.nbytes += n
        if self.nbytes > self.cap_bytes:
            self._shrink()
        if abs(self.nbytes - self._reported) >= REPORT_BYTES:   # not a gauge write per frame
            self._report()

    def _report(self) -> None:
        self._reported = self.nbytes
        self.metrics.stream_bytes.set(self.nbytes)

    def ended(self, stream: StreamLog) -> None:
        self._report()
        # in an empty context: a timer keeps the one it is made in (the request's, through
        # Sanic's request variable) alive until it fires
        asyncio.get_running_loop().call_later(self.resume_s, self._expire, stream,
                                              context=contextvars.Context())

    def _expire(self, stream: StreamLog) -> None:
        if self.logs.get(stream.stream_id) is stream:
            self._drop(stream)

    def _drop(self, stream: StreamLog) -> None:
        del self.logs[stream.stream_id]
        self.nbytes -= stream.nbytes
        self._report()
        self.metrics.stream_logs.set(len(self.logs))

    def _shrink(self) -> None:
        ended = sorted((s for s in self.logs.values() if s.ended and not s.readers),
                       key=lambda s: s.ended_at)
        for stream in ended:
            if self.nbytes <= self.cap_bytes:
                return
            self._drop(stream)
            self.metrics.stream_evictions.inc()
        for stream in list(self.logs.values()):
            if self.nbytes <= self.cap_bytes:
                return
            self.nbytes -= stream.trim_sent()


FRAME_ID = re.compile(r"-1|0|[1-9][0-9]{0,17}", re.ASCII)


def parse_after(http: sanic.Request) -> int:
    """The last frame a client has: `?after=N` (`?starting_after=N`, OpenAI's Responses
    parameter: its sequence_number is the frame id), else Last-Event-ID; -1 (none)."""
    name = "after" if "after" in http.args else "starting_after"
    raw = http.args.get(name)
    if raw is None:
        raw, name = http.headers.get("last-event-id"), "Last-Event-ID"
    if raw is None or raw == "":
        return -1
    if not FRAME_ID.fullmatch(raw):   # int() would also take "+2", "2_0", " 2", "２"
        raise InvalidRequest(f"{name} is {raw!r:.40}; it must be the integer id of the last "
                             "frame received: decimal digits (frame ids start at 0), or -1 for none",
                             param=name)
    return int(raw)


async def serve(http: sanic.Request, store: StreamStore, stream_id: str, resumable: bool,
                keep_alive_s: float, produce: Callable[[StreamLog], Awaitable[T]],
                detach: Callable[[asyncio.Task[T]], None], background: bool = False) -> T:
    """Run `produce(log)` (it appends the stream's frames) as its own task and send the log to
    this connection. When the client leaves, a resumable stream's producer runs on (`detach`
    hands it the request's settling), any other is cancelled and awaited. `background`: it
    runs on however long nobody reads it."""
    resumable = resumable or background
    stream = store.open(stream_id, resumable)
    stream.background = background

    async def run() -> T:
        try:
            return await produce(stream)
        except asyncio.CancelledError:
            stream.end(cancelled=True)
            raise
        finally:
            stream.end()
            # an ended log is kept for resumes; its task is not: a task holds its context, and
            # so the whole request (Sanic's request, its generation) for stream_resume_s,
            # hundreds of objects a request for each full collection to walk
            stream.task = None

    task = stream.task = asyncio.get_running_loop().create_task(run())
    try:
        response = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
        await stream.follow(response, -1, keep_alive_s, primary=True)
    except BaseException:   # the client left (cancelled), or its connection failed a write
        if resumable and not task.done():
            detach(task)
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        raise
    result = await task
    if not stream.body_ended:
        await response.eof()
    return result


async def resume(http: sanic.Request, store: StreamStore, stream_id: str,
                 keep_alive_s: float) -> None:
    """GET /v1/streams/{id}: the frames after Last-Event-ID / ?after=N, then the rest live."""
    after = parse_after(http)
    stream = store.get(stream_id)
    if after >= stream.num_frames:   # a frame this stream has not sent (yet)
        state = "ended at" if stream.ended else "has sent up to"
        raise InvalidRequest(f"{'after' if 'after' in http.args else 'Last-Event-ID'} is "
                             f"{after}; stream {stream_id!r} {state} frame "
                             f"{stream.num_frames - 1}", param="after")
    if after + 1 < stream.first:
        store.metrics.stream_resumes.labels("evicted").inc()
        raise NotFound(f"stream {stream_id!r} no longer holds frame {after + 1} (it holds "
                       f"{stream.first}..{stream.num_frames - 1}): server.stream_resume_mb "
                       "was reached", param="after", code="stream_frames_evicted")
    store.metrics.stream_resumes.labels("ok").inc()
    response = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
    await stream.follow(response, after, keep_alive_s)
    await response.eof()
