"""PoolEngine: `app.ctx.engine` when models run in their own engine processes (pool=… or
server.isolate=true), the EngineClient for what the server asks of the engine as a whole.
Any thread."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pipeserve.core.client import EngineLoad, EngineState
from pipeserve.core.events import Flush, answer
from pipeserve.errors import EngineUnavailable
from pipeserve.metrics import Metrics

if TYPE_CHECKING:
    from pipeserve.pool.pool import ModelPool


class PoolEngine:
    """`app.ctx.engine` of a pool, an EngineClient (pipeserve/core/client.py) for what the server
    asks of "the engine" as a whole (state, the load for the drain and /health, the flush at
    shutdown, stop). It has no limits (each member's engine publishes its own) and runs no
    request: requests go to their member's engine."""

    def __init__(self, pool: ModelPool, metrics: Metrics) -> None:
        self.pool, self.metrics = pool, metrics
        self.stopped = False
        self.limits = None
        self.startup_error: BaseException | None = None

    @property
    def state(self) -> EngineState:
        """A pool serves while any member can; one model alone (server.isolate=true) is as its
        engine process is: /health fails while that process loads or is dead."""
        if self.stopped:
            return EngineState.STOPPED
        return self.pool.single_state() if self.pool.single else EngineState.READY

    def start(self) -> None:
        pass

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def load(self) -> EngineLoad:
        loads = [m.engine.load() for m in self.pool.members.values() if m.engine is not None]
        return EngineLoad(sum(x.num_waiting for x in loads), sum(x.num_running for x in loads),
                          sum(x.num_inflight for x in loads), sum(x.num_queued for x in loads))

    def submit(self, request: Any, stream: Any) -> None:
        raise EngineUnavailable("a pool runs requests on its members' engines")

    def abort(self, request_id: str) -> None:
        pass

    def coming(self) -> None:
        """Which model the connection's request names is not known yet: every live one."""
        for engine in self.pool.live():
            engine.coming()

    def command(self, cmd: Any) -> Future[Any]:
        """A Flush goes to every loaded member (True once each has answered that it
        flushed); other commands run on the member a request is routed to."""
        if not isinstance(cmd, Flush):
            answer(cmd.future, error=EngineUnavailable(
                "a pool runs commands on its members' engines"))
            return cmd.future
        parts = [e.command(Flush()) for e in self.pool.live()]
        if not parts:
            answer(cmd.future, True)
        left = [len(parts)]
        lock = threading.Lock()

        def one_done(part: Future[Any]) -> None:   # a member's reader thread
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if part.exception() is not None:
                answer(cmd.future, error=part.exception())
            elif last:
                answer(cmd.future, True)

        for part in parts:
            part.add_done_callback(one_done)
        return cmd.future

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped = True
        self.pool.stop()
