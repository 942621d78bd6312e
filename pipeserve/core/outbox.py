"""Outbox: the engine's side of the request streams — which stream each running request
posts to, the events of one loop pass gathered and handed to the event loop with one wake-up,
and the request-level metrics those events carry. Engine thread only."""
from __future__ import annotations

import time

from pipeserve.core.events import Event, Failed, Finished, TokenDelta
from pipeserve.metrics import Metrics
from pipeserve.request import Request
from pipeserve.core.stream import RequestStream, post_many


class Outbox:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}
        self._pending: list[tuple[RequestStream, Event]] = []
        self.num_done = 0   # requests finished or failed (read by any thread)

    def open(self, request_id: str, stream: RequestStream) -> None:
        self._streams[request_id] = stream

    def tokens(self, req: Request, event: TokenDelta, now: float | None = None) -> None:
        """A token delta; the first one of a request times its TTFT, later ones the ITL."""
        now = time.perf_counter() if now is None else now
        if req.first_token_s is None:
            req.first_token_s = now
            self.metrics.ttft.observe(now - req.arrival_s)
        else:
            self.metrics.itl.observe(now - req.last_token_s)
        req.last_token_s = now
        self.post(req.request_id, event)

    def replay(self, running: list[Request]) -> None:
        """Send resumed requests the output their checkpoint already holds."""
        for req in running:
            if req.replay_ids:
                req.first_token_s = req.last_token_s = time.perf_counter()
                self.post(req.request_id, TokenDelta(req.request_id, req.replay_ids,
                                                           None, req.batch_size_max))
                req.replay_ids = None

    def post(self, request_id: str, event: TokenDelta | Finished | Failed) -> None:
        stream = self._streams.get(request_id)
        if isinstance(event, (Finished, Failed)):
            self._streams.pop(request_id, None)
            self.num_done += 1
            if isinstance(event, Finished):
                self.metrics.generation_tokens.inc(event.num_output_tokens)
                self.metrics.prompt_tokens.inc(event.num_prompt_tokens)
                self.metrics.cached_tokens.inc(event.num_cached_tokens)
        if stream is not None:
            self._pending.append((stream, event))

    def flush(self) -> None:
        """Hand this pass's events to the event loop (one wake-up)."""
        if self._pending:
            post_many(self._pending)
            self._pending = []
