"""Commands into the engine and events out of it. Commands: any thread → engine inbox;
events: engine thread → RequestStream on the event loop."""
from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeserve.errors import ServeError
from pipeserve.request import FinishReason, Request, TokenLogprob



class Sink(Protocol):
    """Where a request's events go: a RequestStream (pipeserve/core/stream.py, which imports
    this module), or a pool child's stand-in for one (pipeserve/pool/child.py)."""

    def post(self, event: Event) -> None: ...


@dataclass(slots=True)
class Submit:
    request: Request
    stream: Sink


@dataclass(slots=True)
class Abort:
    request_id: str
    reason: FinishReason = FinishReason.ABORT


def answer(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Any thread: a command's one answer, its result or its error (the ServeError its handler
    raises). An answer to a waiter that gave up (cancelled), or a second one, is dropped."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


@dataclass(slots=True)
class Flush:
    """Write every dirty prompt-cache entry to disk; `future` is True once they are there."""

    future: Future[Any] = field(default_factory=Future)

    def reply(self, written: threading.Event | None) -> None:
        if written is None:
            answer(self.future, True)
            return
        threading.Thread(target=lambda: (written.wait(), answer(self.future, True)),
                         daemon=True, name="pipeserve-flush-wait").start()


@dataclass(slots=True)
class AdapterSwap:
    """Mount (`mount`) or unmount the adapter `adapter_id` between steps; `future` gets
    `result` (its /v1/adapters entry) or raises `error` (pipeserve/adapters/swap.py)."""

    adapter_id: str
    mount: bool
    future: Future[Any] = field(default_factory=Future)
    result: dict[str, object] | None = None
    error: ServeError | None = None


@dataclass(slots=True)
class Settle:
    """Answered True between passes, once the pass running when it came has ended: the rows
    that finished before it are retired (their KV stored, then freed). A finish is posted
    before that bookkeeping, so a caller that reads the engine's state after a request ended
    (a test, a probe) sends this first."""

    future: Future[Any] = field(default_factory=Future)


Command = Submit | Abort | Flush | AdapterSwap | Settle


@dataclass(slots=True)
class TokenDelta:
    """New output tokens of one request. `batch_size_max`: the most rows in one engine step
    while it ran, so far (the record's batch size of a request that a stop string ends before
    its Finished event; 0 where unknown)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    batch_size_max: int = 0


@dataclass(slots=True)
class Finished:
    """A request ended. `extras` carries engine-side facts for the response's record:
    `batch_size_max` (int): the most rows in one engine step while this request decoded."""

    request_id: str
    reason: FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    extras: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class Failed:
    request_id: str
    error: ServeError


Event = TokenDelta | Finished | Failed
