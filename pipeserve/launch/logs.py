"""Log formatters for Hydra's job_logging config (pipeserve/conf/hydra/job_logging/pipeserve.yaml):
`server.log_format` picks text lines or one JSON object per line. Any thread. And the
handlers' own threads (`own_threads`), so no thread that logs waits on a log's reader."""
from __future__ import annotations

import copy
import json
import logging
import logging.handlers
import os
import queue
import select
import stat
import time
from typing import Any

TEXT_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, the record's `extra`
    fields, and exc (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
                               "logger": record.name, "msg": record.getMessage()}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:   # rendered when it was queued (own_threads)
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(log_format: Any = "text") -> logging.Formatter:
    """The formatter `server.log_format` names: "text" or "json" (a str or the LogFormat enum,
    as Hydra's resolved config hands it over)."""
    name = getattr(log_format, "value", log_format)
    return JsonFormatter() if name == "json" else logging.Formatter(TEXT_FORMAT)


# -- the handlers' own threads ----------------------------------------------------------------
# A log write that blocks (stdout a pipe nobody reads, a paused terminal) must not block the
# thread that logged: the event loop (every client would wait) or the engine (the device would).

QUEUE_RECORDS = 10_000   # records waiting for one handler before new ones are dropped
DIRECT_CHARS = 2_048     # a longer message, or a traceback, always goes by the queue
_queued: list[tuple["_Queued", "_Listener"]] = []
_drops: dict[str, Any] = {"counter": None}


class _Queued(logging.handlers.QueueHandler):
    """Stands in for one real handler (`target`). A record is written at once, on the thread
    that logged it, while the target's reader keeps up (nothing waits in the queue, and its pipe
    or terminal has room for the line); otherwise it waits in a bounded queue for the target's
    own thread, and past `capacity` waiting records it is dropped and counted."""

    def __init__(self, target: logging.Handler, capacity: int) -> None:
        super().__init__(queue.Queue(capacity))
        self.target = target
        self.setLevel(target.level)
        self.poll = _poller(target)   # None: a regular file, or no descriptor (never blocks)
        self.pending = 0    # records queued and not yet written (under the handler's lock)
        self.dropped = 0
        self.reported = 0   # drops the target's thread has written a line about

    def emit(self, record: logging.LogRecord) -> None:
        """Called holding this handler's lock (Handler.handle)."""
        if self.pending == 0 and self._room(record):
            self.target.handle(record)
            return
        try:
            self.queue.put_nowait(self.prepare(record))
            self.pending += 1
        except queue.Full:
            self.dropped += 1
            counter = _drops["counter"]
            if counter is not None:
                counter.inc()
        except Exception:
            self.handleError(record)

    def _room(self, record: logging.LogRecord) -> bool:
        """The target can take this record now without blocking."""
        if self.poll is None:
            return True
        if record.exc_info or record.stack_info or len(str(record.msg)) > DIRECT_CHARS:
            return False
        return bool(self.poll.poll(0))

    def written(self) -> None:
        """The target's thread wrote a queued record."""
        self.acquire()
        try:
            self.pending -= 1
        finally:
            self.release()

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The message merged with its args and a traceback rendered now (the objects they
        name may change before the target's thread formats the record); `extra` fields stay."""
        record = copy.copy(record)
        record.msg, record.args = record.getMessage(), None
        if record.exc_info:
            record.exc_text = record.exc_text or _PLAIN.formatException(record.exc_info)
            record.exc_info = None
        return record


def _poller(handler: logging.Handler) -> Any:
    """A poll object for the handler's descriptor when writing to it can block (a pipe, a
    socket, a terminal); None for a regular file or a stream without a descriptor."""
    try:
        fd = handler.stream.fileno()   # type: ignore[attr-defined]
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return None
    except (AttributeError, OSError, ValueError):
        return None
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return poll


class _Listener(logging.handlers.QueueListener):
    """The target's own thread: writes what waits, and first a line about what was dropped."""

    def __init__(self, owner: _Queued) -> None:
        super().__init__(owner.queue, owner.target, respect_handler_level=True)
        self.owner = owner

    def handle(self, record: logging.LogRecord) -> None:
        owner = self.owner
        try:
            if owner.dropped != owner.reported:   # the reader is back: say what it missed
                missed, owner.reported = owner.dropped - owner.reported, owner.dropped
                owner.target.handle(logging.LogRecord(
                    "pipeserve", logging.WARNING, __file__, 0,
                    "%d log records were dropped: this log's reader did not keep up while %d "
                    "waited (server.log_buffer_records; pipeserve_log_records_dropped_total)",
                    (missed, owner.queue.maxsize), None))
            super().handle(record)
        finally:
            owner.written()


_PLAIN = logging.Formatter()


def own_threads(capacity: int = QUEUE_RECORDS) -> None:
    """From now on no thread that logs waits on a log's reader: each of the root logger's
    handlers gets a thread of its own for when its reader falls behind (until `stop_threads`)."""
    root = logging.getLogger()
    for i, handler in enumerate(list(root.handlers)):
        if isinstance(handler, _Queued):
            continue
        queued = _Queued(handler, capacity)
        listener = _Listener(queued)
        listener.start()
        _queued.append((queued, listener))
        root.handlers[i] = queued


def count_drops(counter: Any) -> None:
    """Dropped records are counted in `counter` (a prometheus Counter) from now on, and so far."""
    _drops["counter"] = counter
    counter.inc(sum(q.dropped for q, _ in _queued))


def stop_threads(timeout_s: float = 2.0) -> bool:
    """The handlers' threads write what waits and stop, and the root logger gets its handlers
    back. False when one could not finish within `timeout_s` (its reader is stuck): then its
    handler must not be flushed either, or the process would wait on that reader too."""
    root = logging.getLogger()
    done = True
    for queued, listener in _queued:
        if queued in root.handlers:   # later records go straight to the handler
            root.handlers[root.handlers.index(queued)] = queued.target
        try:
            queued.queue.put_nowait(listener._sentinel)
        except queue.Full:
            done = False
    deadline = time.monotonic() + timeout_s
    for queued, listener in _queued:
        thread = listener._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            done = done and not thread.is_alive()
    _queued.clear()
    return done
