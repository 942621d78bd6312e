"""EngineClient: the HTTP side's only view of an engine, whether it runs on a thread beside the
event loop (Engine, EmbedEngine), in a child process (the pool's ChildEngine) or is a pool of
them (PoolEngine). What it reads are published values: frozen EngineLimits (core/limits.py),
replaced whole when they change, and an EngineLoad snapshot. Any thread; no mlx."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pipeserve.errors import EngineUnavailable

if TYPE_CHECKING:
    from pipeserve.core.limits import EngineLimits
    from pipeserve.core.stream import RequestStream
    from pipeserve.request import Request


class EngineState(Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineLoad(NamedTuple):
    """How busy an engine is, as of the call: requests submitted and not yet in a batch row
    (`num_waiting`), rows running, requests submitted and not finished (`num_inflight`), and
    of the waiting ones those beyond the free rows (`num_queued`: they really queue).
    Immutable; a tuple because the output path reads one per token event (a frozen
    dataclass costs about three times as much to make)."""

    num_waiting: int = 0
    num_running: int = 0
    num_inflight: int = 0
    num_queued: int = 0

    @classmethod
    def of(cls, waiting: int, running: int, inflight: int, max_rows: int) -> EngineLoad:
        free = max(0, max_rows - running)
        return cls(waiting, running, inflight, max(0, waiting - free))


class EngineClient(Protocol):
    """What the server, the request stages and the output path use of an engine.

    `limits` is None until the model has loaded (and always for a pool as a whole); an
    engine replaces it whole when a published fact changes (an adapter mounted), so a reader
    holding one sees a consistent set. `submit` raises EngineUnavailable unless READY; events
    for a request arrive on its stream, ending with one Finished or Failed. `command` is the
    one way to ask the engine thread for a result (a Flush of the prompt cache, a Score, an
    Embed, an AdapterSwap): the Future it returns (the command's own) gets the result, or
    raises the command's ServeError; an engine that is not READY answers it with a 503."""

    state: EngineState
    limits: EngineLimits | None
    startup_error: BaseException | None

    def start(self) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def load(self) -> EngineLoad: ...

    def submit(self, request: Request, stream: RequestStream) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def coming(self) -> None:
        """A client opened a connection: a request is probably on its way (an idle engine
        gathering a burst waits for it as for an arrival). A hint; cheap; any thread."""

    def command(self, cmd: Any) -> Future[Any]: ...

    def stop(self, timeout: float = 10.0) -> None: ...


async def reply_of(future: Future[Any], timeout_s: float, what: str) -> Any:
    """Event loop: a command's answer, awaited without holding an executor thread: its result,
    its error raised, or a 503 saying the engine did not `what` within `timeout_s`."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except asyncio.TimeoutError:
        raise EngineUnavailable(f"the engine did not {what} in {timeout_s:.0f} s") from None
