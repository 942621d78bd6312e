"""The engine process of one pool member (started with multiprocessing's `spawn`): it owns MLX,
the Engine thread and the prompt cache; its main thread reads commands from the pipe, and the
engine thread's outbox writes each step's events as one message (PipeLoop)."""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from pipeserve.config import ServeConfig
from pipeserve.pool import codec
from pipeserve.core.engine import Engine
from pipeserve.core.events import AdapterSwap, Failed, Flush
from pipeserve.core.scoring import Score
from pipeserve.core.stream import post_many
from pipeserve.embed.engine import Embed, EmbedEngine
from pipeserve.errors import EngineUnavailable, ServeError
from pipeserve.grammar.constraint import GrammarCompiler
from pipeserve.launch.checks import ENGINE_DIED
from pipeserve.launch.logs import own_threads, stop_threads
from pipeserve.launch.stacks import dump_stacks_on_sigusr1
from pipeserve.metrics import Metrics, quiet_collector

log = logging.getLogger("pipeserve.pool")
REMOUNT_S = 600.0   # the most a restarted core waits for one adapter to mount again


class PipeLoop:
    """Stands in for the event loop of every stream in this process: `post_many` hands it a
    step's events with one call_soon_threadsafe, which becomes one message on the pipe."""

    def __init__(self, send: Any, engine: Any) -> None:
        self.send, self.engine = send, engine

    def call_soon_threadsafe(self, _deliver: Any, batch: list[tuple[Any, Any]]) -> None:
        load = self.engine.load()
        self.send(codec.encode_step([e for _, e in batch], load.num_waiting, load.num_running))


class ChildStream:
    """The engine's RequestStream here: its `_loop` is the pipe (pipeserve/stream.post_many)."""

    __slots__ = ("_loop", "finished")

    def __init__(self, loop: PipeLoop) -> None:
        self._loop, self.finished = loop, False

    def post(self, event: Any) -> None:
        post_many([(self, event)])


def _facts(engine: Any, load_s: float) -> dict[str, Any]:
    """What the parent needs to tokenize, admit and detokenize for this model: the model's
    files and facts, and the engine's published limits."""
    limits = engine.limits
    loaded = limits.model
    return {"path": str(loaded.path), "config": loaded.config, "fingerprint": loaded.fingerprint,
            "max_context": loaded.max_context, "generation_defaults": loaded.generation_defaults,
            "num_params": loaded.num_params, "weight_bytes": loaded.weight_bytes,
            "compute_dtype": loaded.compute_dtype, "limits": codec.encode_limits(limits),
            "pid": os.getpid(), "load_s": load_s}


def main(conn: Connection, cfg: ServeConfig, model_id: str,
         adapters: list[str] | None = None) -> None:
    """`adapters`: the ids a restarted core had mounted (None: a first load, the launch's)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{model_id} pid {os.getpid()}] "
                               "%(name)s: %(message)s")
    own_threads(cfg.server.log_buffer_records)   # a stuck stderr never holds the engine
    sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)
    dump_stacks_on_sigusr1()
    sender = Sender(conn)
    send = sender.send

    from prometheus_client import CollectorRegistry, generate_latest

    t0 = time.perf_counter()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    if cfg.model.encoder:   # an embedding or reranking model (pipeserve/embed/engine.py)
        engine: Any = EmbedEngine(cfg, metrics)
    else:
        engine = Engine(cfg, metrics, on_death=lambda: _exit_after_death(engine, sender))
    engine.start()
    if not engine.wait_ready():
        send({"op": "start_failed", "error": f"{type(engine.startup_error).__name__}: "
                                             f"{engine.startup_error}"})
        sender.close()
        _exit(0)
    if adapters is not None:
        _remount(engine, adapters)
    quiet_collector(metrics)   # as the server at ready; its pauses under this model's label
    send({"op": "ready", "facts": _facts(engine, time.perf_counter() - t0)})
    _serve(conn, send, engine, lambda: generate_latest(registry).decode())
    sender.close()   # what the engine said last (its final events, replies) goes out first
    _exit(0)


class Sender:
    """Writes to the pipe from its own thread, so the engine thread never waits on the pipe
    (a parent busy writing streams reads it late; in-process, posting never blocks either)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pipeserve-pipe-send",
                                        daemon=True)
        self._thread.start()

    def send(self, message: dict[str, Any]) -> None:   # any thread
        self._queue.put(codec.dumps(message))

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:   # the parent is gone
                return


def _serve(conn: Connection, send: Any, engine: Any, exposition: Any) -> None:
    loop = PipeLoop(send, engine)
    grammars = _Grammars(engine)
    while True:
        try:
            msg = codec.loads(conn.recv_bytes())
        except (EOFError, OSError):   # the parent is gone: nobody to serve
            break
        op = msg["op"]
        if op == "submit":
            req = codec.decode_request(msg["req"])
            if req.constraint is not None:   # compiled off this thread: the pipe keeps moving
                grammars.submit(req, loop)
                continue
            try:
                engine.submit(req, ChildStream(loop))
            except ServeError as e:
                loop.call_soon_threadsafe(None, [(None, Failed(req.request_id, e))])
        elif op == "abort":
            if not grammars.cancel(msg["id"]):
                engine.abort(msg["id"])
        elif op == "coming":
            engine.coming()
        elif op == "flush":   # answered once every dirty entry is on disk
            engine.command(Flush()).add_done_callback(lambda f, n=msg["n"]: send(
                {"op": "reply", "of": "flush", "n": n, "ok": f.exception() is None}))
        elif op == "embed":   # an embedding model's batch (pipeserve/embed/engine.py)
            engine.command(Embed(msg["ids"])).add_done_callback(lambda f, n=msg["n"]: send(
                {"op": "reply", "n": n, **codec.embed_reply_fields(f)}))
        elif op == "score":   # prompt logprobs (pipeserve/core/scoring.py), between steps
            engine.command(Score(msg["ids"], msg["top"])).add_done_callback(
                lambda f, n=msg["n"]: send({"op": "reply", "n": n,
                                            **codec.score_reply_fields(f)}))
        elif op == "adapter":   # hot-swap (pipeserve/adapters/swap.py), between steps
            engine.command(AdapterSwap(msg["id"], msg["mount"])).add_done_callback(
                lambda f, n=msg["n"]: send({"op": "reply", "n": n, **codec.swap_reply_fields(
                    f, engine.limits.adapters if engine.limits is not None else None)}))
        elif op == "metrics":
            send({"op": "reply", "of": "metrics", "n": msg["n"], "body": exposition()})
        elif op == "stop":
            break
    engine.stop(30.0)   # the engine thread's exit drains the SSD writer


def _exit_after_death(engine: Any, sender: Sender) -> None:
    """The engine died while serving (engine thread, or abandon's caller): this process exits
    with ENGINE_DIED once the engine thread has ended (its cleanup drains the SSD writer) and
    what it said last (every request failed) is on the pipe, and the parent restarts it as
    after any exit. A process that stayed up would answer 503 while /health said 200."""
    def run() -> None:
        engine.stop(30.0)
        sender.close()
        _exit(ENGINE_DIED)
    threading.Thread(target=run, name="pipeserve-engine-died", daemon=True).start()


def _remount(engine: Any, wanted: list[str]) -> None:
    """A restarted core serves the adapters its predecessor had (mounted or unmounted over
    HTTP since launch), through the same swaps; one that no longer mounts is logged and left
    out, never a failed load."""
    limits = engine.limits
    have = limits.adapters.ids if limits is not None and limits.adapters is not None else []
    swaps = ([AdapterSwap(i, False) for i in have if i not in wanted]
             + [AdapterSwap(i, True) for i in wanted if i not in have])
    for cmd in swaps:
        try:
            engine.command(cmd).result(REMOUNT_S)
        except Exception as e:   # ServeError, or the engine did not answer in time
            log.warning("adapter %s was not %s again after the restart: %s", cmd.adapter_id,
                        "mounted" if cmd.mount else "unmounted", e)


class _Grammars:
    """The parent compiled (and so validated and bounded) the request's constraint; the matcher
    that advances on the engine thread is compiled again here, against the same tokenizer, on a
    thread of its own (then submitted), so a compile never holds up the pipe's other commands.
    An abort that arrives while its request compiles ends it there."""

    def __init__(self, engine: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.engine = engine
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._pending: dict[str, bool] = {}   # request id → cancelled
        self._lock = threading.Lock()

    def submit(self, req: Any, loop: PipeLoop) -> None:
        with self._lock:
            self._pending[req.request_id] = False
        self._pool.submit(self._compile_and_submit, req, loop)

    def cancel(self, request_id: str) -> bool:
        """True when the request is still compiling (it ends when the compile does)."""
        with self._lock:
            if request_id not in self._pending:
                return False
            self._pending[request_id] = True
            return True

    def _compile_and_submit(self, req: Any, loop: PipeLoop) -> None:
        error: ServeError | None = None
        try:
            req.grammar = self.matcher(req.constraint)
        except ServeError as e:
            error = e
        except Exception as e:   # the thread's boundary: the request fails, the child goes on
            log.exception("grammar compile failed for %s", req.request_id)
            error = EngineUnavailable(f"the grammar did not compile ({type(e).__name__})")
        with self._lock:
            cancelled = self._pending.pop(req.request_id, False)
        if cancelled and error is None:
            error = EngineUnavailable("the request was cancelled while its grammar compiled",
                                      code="cancelled")
        if error is None:
            try:
                self.engine.submit(req, ChildStream(loop))
                return
            except ServeError as e:
                error = e
        loop.call_soon_threadsafe(None, [(None, Failed(req.request_id, error))])

    def matcher(self, constraint: Any) -> Any:
        if self._compiler is None:
            limits = self.engine.limits
            tokenizer = limits.model.tokenizer
            self._compiler = GrammarCompiler(tokenizer, limits.vocab_size,
                                             tokenizer.eos_token_ids)
        return self._compiler.matcher(constraint)


def _exit(code: int) -> None:
    """As serve.py: no interpreter teardown (MLX's thread state can abort in it)."""
    if stop_threads():   # else a handler's reader is stuck, and a flush would wait on it
        logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
