"""ChildEngine: the parent's stand-in for an Engine that runs in a child process — the same
EngineClient (pipeserve/core/client.py) the server, the request stages and the output path
use (limits, load, submit, abort, state, flush), over a pipe. Its reader thread turns each step's message into one wake-up
of the event loop; a child that dies fails the requests it held. Any thread."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from pipeserve.config import ServeConfig
from pipeserve.core.client import EngineLoad, EngineState
from pipeserve.core.limits import EngineLimits
from pipeserve.errors import EngineUnavailable, ServeError
from pipeserve.core.events import AdapterSwap, Failed, Finished, Flush, answer
from pipeserve.model.loader import LoadedModel, _chat_template
from pipeserve.metrics import Metrics
from pipeserve.pool import child, codec
from pipeserve.request import Request
from pipeserve.core.stream import RequestStream, post_many
from pipeserve.core.scoring import Score
from pipeserve.embed import engine as embedding
from pipeserve.embed.engine import Embed

log = logging.getLogger("pipeserve.pool")
SPAWN = mp.get_context("spawn")   # never fork: the parent may have imported MLX


class ChildEngine:
    def __init__(self, model_id: str, cfg: ServeConfig, metrics: Metrics,
                 previous: EngineLimits | None = None,
                 on_exit: Callable[[ChildEngine], None] | None = None) -> None:
        """`previous`: the limits of the engine this one replaces (its tokenizer is reused,
        its mounted adapters mounted again)."""
        self.model_id, self.cfg, self.metrics = model_id, cfg, metrics
        self.state = EngineState.LOADING
        self.limits: EngineLimits | None = None   # from the child's facts once it is ready
        self.startup_error: BaseException | None = None
        self.facts: dict[str, Any] = {}
        self.exitcode: int | None = None
        self.last_event_s = time.monotonic()
        self._coming_sent = 0.0   # when `coming` last told the child
        self._previous, self._on_exit = previous, on_exit
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        # commands waiting for their reply, by id: (the command's op, set on reply, the reply)
        self._replies: dict[int, tuple[str, threading.Event, list[Any]]] = {}
        # Flush, Score (pipeserve/core/scoring.py) and Embed (pipeserve/embed/engine.py)
        # awaiting the child's reply
        self._commands: dict[int, Any] = {}
        self._seq = itertools.count()
        self._stopping = False
        self._num_submitted = self._num_done = self._child_waiting = self._child_running = 0
        self._conn, child_conn = SPAWN.Pipe()
        adapters = (previous.adapters.ids if previous is not None
                    and previous.adapters is not None else None)
        self._proc = SPAWN.Process(target=child.main,
                                   args=(child_conn, cfg, model_id, adapters),
                                   name=f"pipeserve-{model_id}", daemon=True)
        self._child_conn = child_conn
        self._reader = threading.Thread(target=self._read, name=f"pipeserve-pipe-{model_id}",
                                        daemon=True)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._proc.start()
        self._child_conn.close()   # the child holds its end; EOF here once it exits
        self._reader.start()

    @property
    def last_limits(self) -> EngineLimits | None:
        """This engine's limits, else (it never became ready) those of the one it replaced:
        what a next engine reuses (the tokenizer) and mounts again (the adapters)."""
        return self.limits if self.limits is not None else self._previous

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    def retire(self) -> None:
        """Take no more requests (any thread): the pool unloads this engine next."""
        with self._lock:
            self._stopping = True
            if self.state is EngineState.READY:
                self.state = EngineState.STOPPED

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the child to stop (its engine drains the SSD writer), then make sure it did."""
        self.retire()
        try:
            self._send({"op": "stop"})
        except EngineUnavailable:
            pass
        self._reader.join(timeout)   # the reader reaps the child once its pipe closes
        if self._reader.is_alive():
            log.warning("model %s: engine process %s did not stop in %.0f s; killing it",
                        self.model_id, self.pid, timeout)
            self.kill()

    def kill(self) -> None:
        """SIGKILL; returns once the reader has reaped it (only the reader joins the child,
        so two threads never race in waitpid)."""
        self._stopping = True
        if self._reader.is_alive() and self.pid is not None:   # not reaped yet: still its pid
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reader.join(10)

    # -- the Engine interface ------------------------------------------------------------
    def load(self) -> EngineLoad:
        """As of the child's last step message (its waiting and running counts)."""
        inflight = self._num_submitted - self._num_done
        rows = self.limits.max_rows if self.limits is not None else 1
        return EngineLoad.of(min(self._child_waiting, inflight), self._child_running, inflight,
                             rows)

    def submit(self, request: Request, stream: RequestStream) -> None:
        with self._lock:   # against _exited: a stream registered here is failed there
            if self.state is not EngineState.READY:
                raise EngineUnavailable(f"the engine of model {self.model_id} is "
                                        f"{self.state.value}; retry")
            self._streams[request.request_id] = stream
            self._num_submitted += 1
        self._send({"op": "submit", "req": codec.encode_request(request)})

    def abort(self, request_id: str) -> None:
        if self.state is EngineState.READY:
            try:
                self._send({"op": "abort", "id": request_id})
            except EngineUnavailable:
                pass

    def coming(self) -> None:
        """Only to an engine that gathers bursts (a gap: a GPU's by default), at most one
        message a millisecond: its gap is a few of them."""
        now = time.monotonic()
        limits = self.limits
        if (self.state is not EngineState.READY or limits is None
                or not self.cfg.scheduler.arrival_gap_s(limits.device or "")
                or now - self._coming_sent < 0.001):
            return
        self._coming_sent = now
        try:
            self._send({"op": "coming"})
        except EngineUnavailable:
            pass

    def command(self, cmd: Any) -> Future[Any]:
        """A Flush, a prompt Score, an Embed or an AdapterSwap goes over the pipe, its reply
        keyed by `n`; a swap's reply carries the child's new adapter set, published here
        before the command's future is answered."""
        n = next(self._seq)
        self._commands[n] = cmd
        message = _message(cmd, n)
        try:
            if self.state is not EngineState.READY:
                raise EngineUnavailable(f"the engine of model {self.model_id} is "
                                        f"{self.state.value}; retry")
            self._send(message)
        except EngineUnavailable as e:
            if self._commands.pop(n, None) is not None:
                answer(cmd.future, error=e)
        return cmd.future

    def metrics_text(self, timeout: float = 5.0) -> str | None:
        """The child's /metrics exposition, or None when it does not answer in time."""
        if self.state is not EngineState.READY:
            return None
        done, box = self._ask({"op": "metrics"})
        return box[0].get("body") if done.wait(timeout) and box else None

    # -- pipe ----------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        data = codec.dumps(message)
        try:
            with self._lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:   # the child is gone; the reader fails its requests
            raise EngineUnavailable(f"the engine of model {self.model_id} has stopped") from e

    def _ask(self, message: dict[str, Any]) -> tuple[threading.Event, list[Any]]:
        """Send a command under a fresh id; the returned event is set when the reply carrying
        that id (and naming the same command) arrives, or when the child goes away."""
        n = next(self._seq)
        done, box = threading.Event(), []
        with self._lock:
            self._replies[n] = (message["op"], done, box)
        try:
            self._send({**message, "n": n})
        except EngineUnavailable:
            with self._lock:
                self._replies.pop(n, None)
            done.set()
        return done, box

    def _read(self) -> None:
        closed = False
        while not closed:
            msgs: list[dict[str, Any]] = []
            try:
                msgs.append(codec.loads(self._conn.recv_bytes()))
                while len(msgs) < 64 and self._conn.poll():   # behind: catch up in one go
                    msgs.append(codec.loads(self._conn.recv_bytes()))
            except (EOFError, OSError):
                # poll() is also true at end of file: what was read before it (a child's
                # last words, such as start_failed) is still handled
                closed = True
            events = [m for m in msgs if m["op"] == "ev"]
            if events:
                self._events(events)
            for msg in msgs:
                self._control(msg)
        self._exited()

    def _control(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "reply" and msg["n"] in self._commands:
            cmd = self._commands.pop(msg["n"])
            if isinstance(cmd, AdapterSwap):
                self._publish_adapters(msg)
            _reply(cmd, msg)
        elif op == "reply":
            with self._lock:
                waiting = self._replies.pop(msg["n"], None)
            if waiting is None or waiting[0] != msg.get("of"):
                # a reply nobody asked for under that id: a protocol fault, never a guess
                log.error("model %s: engine process %s replied %r to command %s, which %s",
                          self.model_id, self.pid, msg.get("of"), msg["n"],
                          "was not pending" if waiting is None else f"was {waiting[0]!r}")
                if waiting is None:
                    return
            _, done, box = waiting
            box.append(msg)
            done.set()
        elif op == "ready":
            self._became_ready(msg["facts"])
        elif op == "start_failed":
            self.startup_error = RuntimeError(msg["error"])

    def _events(self, msgs: list[dict[str, Any]]) -> None:
        """Steps' events, to the event loop with one wake-up (one step's, or a backlog's)."""
        items: list[tuple[RequestStream, Any]] = []
        with self._lock:
            for event in (event for msg in msgs for event in codec.decode_step(msg)):
                final = isinstance(event, (Finished, Failed))
                stream = (self._streams.pop(event.request_id, None) if final
                          else self._streams.get(event.request_id))
                if final and stream is not None:
                    self._num_done += 1
                if stream is not None:
                    items.append((stream, event))
            self._child_waiting, self._child_running = msgs[-1]["w"], msgs[-1]["r"]
        self.last_event_s = time.monotonic()
        post_many(items)   # the step's events: one wake-up of the event loop

    def _publish_adapters(self, msg: dict[str, Any]) -> None:
        """A swap reply's adapter set replaces the limits' (whole, as the engine thread does);
        a reply without one (the child exited) leaves them."""
        limits = self.limits
        if limits is not None and "adapters" in msg:
            self.limits = dataclasses.replace(limits,
                                              adapters=codec.decode_adapters(msg["adapters"]))

    def _became_ready(self, facts: dict[str, Any]) -> None:
        try:
            loaded = parent_loaded(facts, self.cfg,
                                   self._previous.model if self._previous is not None else None)
        except Exception as e:  # the tokenizer did not load here: the model cannot serve
            log.exception("model %s: tokenizer failed to load in the server process",
                          self.model_id)
            self.startup_error = e
            self.kill()
            return
        self.facts = facts
        self.limits = codec.decode_limits(facts["limits"], self.cfg, loaded)
        self.state = EngineState.READY
        self._ready.set()

    def _exited(self) -> None:
        """The pipe closed: the child exited (asked to, or killed). Every request it held
        fails with a 503 its client may retry; the pool starts a new child on demand."""
        self._proc.join(10)
        self.exitcode = self._proc.exitcode
        how = (f"killed by signal {-self.exitcode}" if self.exitcode is not None
               and self.exitcode < 0 else f"exit code {self.exitcode}")
        with self._lock:
            was_ready = self.state is EngineState.READY
            self.state = EngineState.STOPPED if self._stopping else EngineState.DEAD
        if self.startup_error is None and not was_ready and self.limits is None:
            self.startup_error = RuntimeError(f"the engine process exited while loading ({how})")
        err: ServeError = EngineUnavailable(
            f"the engine process of model {self.model_id} exited ({how}) while this request "
            "was running; the model is restarted on the next request — retry it",
            code="engine_exited")
        with self._lock:
            streams, self._streams = self._streams, {}
            self._num_done += len(streams)
        post_many([(s, Failed(rid, err)) for rid, s in streams.items()])
        with self._lock:
            pending, self._replies = self._replies, {}
        for _, done, _ in pending.values():
            done.set()
        for n in list(self._commands):
            cmd = self._commands.pop(n, None)
            if cmd is not None:
                _reply(cmd, {})   # no reply: the child is gone
        self._ready.set()
        if streams or not self._stopping:
            log.log(logging.INFO if self._stopping else logging.ERROR,
                    "model %s: engine process %s exited (%s); %d request(s) in flight failed",
                    self.model_id, self.pid, how, len(streams))
        if self._on_exit is not None:
            self._on_exit(self)


def _message(cmd: Any, n: int) -> dict[str, Any]:
    """A command as its pipe message, numbered `n` for its reply."""
    if isinstance(cmd, Score):
        return {"op": "score", "n": n, "ids": cmd.token_ids, "top": cmd.top}
    if isinstance(cmd, Embed):
        return {"op": "embed", "n": n, "ids": cmd.inputs}
    if isinstance(cmd, AdapterSwap):
        return {"op": "adapter", "n": n, "id": cmd.adapter_id, "mount": cmd.mount}
    assert isinstance(cmd, Flush), cmd
    return {"op": "flush", "n": n}


def _reply(cmd: Any, msg: dict[str, Any]) -> None:
    """The child's reply to a command (each module reads its own fields); `msg` is empty when
    the child exited before it replied."""
    if isinstance(cmd, embedding.Embed):
        embedding.apply_reply(cmd, msg)
    elif isinstance(cmd, Score):
        codec.apply_score_reply(cmd, msg)
    elif isinstance(cmd, AdapterSwap):
        codec.apply_swap_reply(cmd, msg)
    elif msg.get("ok"):
        answer(cmd.future, True)
    else:
        answer(cmd.future, error=EngineUnavailable("the engine process did not flush its "
                                                   "prompt cache (it exited, or the write "
                                                   "failed)"))


def parent_loaded(facts: dict[str, Any], cfg: ServeConfig,
                  previous: LoadedModel | None) -> LoadedModel:
    """The model as the parent holds it: the tokenizer and facts, no weights (those live in
    the child). A restart of the same weights reuses the tokenizer already loaded."""
    if previous is not None and previous.fingerprint == facts["fingerprint"]:
        tokenizer = previous.tokenizer
    else:
        from mlx_lm.utils import load_tokenizer

        path = Path(facts["path"])
        tokenizer = load_tokenizer(path, eos_token_ids=facts["config"].get("eos_token_id"))
        if cfg.model.chat_template is not None:
            tokenizer._tokenizer.chat_template = _chat_template(cfg.model.chat_template)
    return LoadedModel(
        model=None, tokenizer=tokenizer, path=Path(facts["path"]), config=facts["config"],
        fingerprint=facts["fingerprint"], max_context=facts["max_context"],
        generation_defaults=facts["generation_defaults"], num_params=facts["num_params"],
        weight_bytes=facts["weight_bytes"], compute_dtype=facts["compute_dtype"])
