"""EmbedEngine: the engine of an embedding model (model.task=embed) or a cross-encoder
(model.task=rerank). One thread owns MLX: it loads the model through mlx-embeddings and runs
Embed commands in forwards of at most BATCH_TOKENS padded tokens (right-padded, with the
attention mask), each forward's rows taken in turn from every command waiting (one large
command never holds the engine while a small one waits), and returns per input the library's
own output in float32: an embedding's pooled vector (`text_embeds`: the pooling its model card defines, L2-normalised), or a
cross-encoder's scores (`pooler_output`: its classifier head, sigmoid for one label).
An EngineClient (pipeserve/core/client.py) as Engine is, so it serves alone or as a pool
member. Public methods: any thread."""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config import ServeConfig
from pipeserve.core.client import EngineLoad, EngineState
from pipeserve.core.events import Flush, answer
from pipeserve.core.limits import EngineLimits
from pipeserve.errors import ConfigError, EngineUnavailable, InvalidRequest, ServeError
from pipeserve.metrics import Metrics
from pipeserve.model.loader import LoadedModel, _fingerprint, resolve_path
from pipeserve.pool.codec import decode_error

log = logging.getLogger(__name__)
BATCH_TOKENS = 16384   # padded tokens (rows x longest row) per forward
BATCH_ROWS = 64   # the rows it publishes (EngineLimits.max_rows): n > 1 checks read it
NOT_GENERATIVE = ("this is an embedding or reranking model (model.task=embed|rerank): use POST "
                  "/v1/embeddings or /v1/rerank")


@dataclass(slots=True)
class Embed:
    """`inputs` (token ids, one list per text) → `result` (one float32 vector each), or
    `error`; `future` gets the result (or raises the error) once either is set."""

    inputs: list[list[int]]
    future: Future[Any] = field(default_factory=Future)
    result: list[list[float]] | None = None
    error: ServeError | None = None


class _Work:
    """An Embed in progress: its rows shortest first, the vectors done so far."""

    def __init__(self, cmd: Embed) -> None:
        self.cmd = cmd
        self.order = sorted(range(len(cmd.inputs)), key=lambda i: len(cmd.inputs[i]))
        self.vectors: list[list[float]] = [[] for _ in cmd.inputs]
        self.next = 0   # rows of `order` already run

    def peek(self, ahead: int) -> int | None:
        """The row `ahead` places after the next one still to run, or None."""
        at = self.next + ahead
        return self.order[at] if at < len(self.order) else None

    def put(self, row: int, vector: list[float]) -> None:
        self.vectors[row] = vector
        self.next += 1

    @property
    def complete(self) -> bool:
        return self.next == len(self.order)


class EmbedEngine:
    def __init__(self, cfg: ServeConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics, self.state = cfg, metrics, EngineState.LOADING
        self.loaded: Any = None   # engine thread: the model it runs
        self.limits: EngineLimits | None = None   # published at load
        self.startup_error: BaseException | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeserve-embed", daemon=True)
        self._num_submitted = self._num_done = 0

    # -- any thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    def load(self) -> EngineLoad:
        """Every Embed not yet answered waits (a batch runs them together)."""
        inflight = self._num_submitted - self._num_done
        return EngineLoad(num_waiting=inflight, num_inflight=inflight)

    def submit(self, request: Any, stream: Any) -> None:
        raise InvalidRequest(NOT_GENERATIVE, param="model")

    def abort(self, request_id: str) -> None:
        pass

    def coming(self) -> None:
        pass

    def command(self, cmd: Any) -> Future[Any]:
        """An Embed runs in the next batch; a Flush is done at once (no prompt cache); a
        generation command (prompt scoring, an adapter swap) fails."""
        if isinstance(cmd, Flush):
            answer(cmd.future, True)
        elif not isinstance(cmd, Embed):
            answer(cmd.future, error=InvalidRequest(NOT_GENERATIVE, param="model"))
        elif self.state is not EngineState.READY:
            answer(cmd.future, error=EngineUnavailable(
                f"the embedding engine is {self.state.value}"))
        else:
            self._num_submitted += 1
            self._queue.put(cmd)
        return cmd.future

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.state is EngineState.READY:
            self.state = EngineState.STOPPED

    # -- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # the startup boundary: kept for start()'s caller
            log.exception("embedding model load failed")
            self.startup_error, self.state = e, EngineState.DEAD
            self._ready.set()
            return
        self.state = EngineState.READY
        self.metrics.engine_up.set(1)
        self._ready.set()
        try:
            active: list[_Work] = []
            stopping = False
            while active or not stopping:
                stopping = self._take(active, block=not active) or stopping
                if active:
                    self._forward(active)
        finally:
            self.metrics.engine_up.set(0)

    def _take(self, active: list[_Work], block: bool) -> bool:
        """Move what arrived into `active` (waiting for one when `block`); True at stop."""
        while block or not self._queue.empty():
            cmd = self._queue.get()
            if cmd is None:
                return True
            active.append(_Work(cmd))
            block = False
        return False

    def _load(self) -> None:
        import mlx.core as mx
        try:
            from mlx_embeddings import load
        except ImportError as e:
            raise ConfigError("model.task=embed loads the model through mlx-embeddings, which is "
                              "not installed: pip install -e .[embed]") from e

        t0 = time.perf_counter()
        path = resolve_path(self.cfg.model)
        model, wrapper = load(str(path))
        tokenizer = getattr(wrapper, "_tokenizer", wrapper)
        config = dict(getattr(model.config, "__dict__", {}))
        heads = [a for a in config.get("architectures") or [] if "SequenceClassification" in a]
        if self.cfg.model.task.value == "rerank" and not heads:
            raise ConfigError(f"model.task=rerank needs a cross-encoder (a sequence-"
                              f"classification head, e.g. ModernBertForSequenceClassification); "
                              f"{path.name} has architectures {config.get('architectures')}")
        from mlx.utils import tree_flatten
        params = tree_flatten(model.parameters())
        probe = model(mx.array([[0]]), attention_mask=mx.ones((1, 1)))
        vec = self._output(probe)
        mx.eval(vec)
        dimensions = int(vec.shape[-1])
        max_context = int(config.get("max_position_embeddings") or 512)
        if self.cfg.model.max_context:
            max_context = min(max_context, self.cfg.model.max_context)
        self.loaded = LoadedModel(
            model=model, tokenizer=tokenizer, path=path, config=_jsonable(config),
            fingerprint=_fingerprint(path), max_context=max_context,
            num_params=sum(int(v.size) for _, v in params),
            weight_bytes=sum(int(v.nbytes) for _, v in params),
            compute_dtype=str(params[0][1].dtype).removeprefix("mlx.core.") if params else "")
        self.limits = EngineLimits.of(self.cfg, self.loaded, max_rows=BATCH_ROWS,
                                      device=str(mx.default_device()), dimensions=dimensions)
        log.info("embedding model %s loaded in %.2f s: %d dimensions, context %d",
                 path.name, time.perf_counter() - t0, dimensions, max_context)

    def _forward(self, active: list[_Work]) -> None:
        """One forward of at most BATCH_TOKENS padded tokens, its rows taken in turn from every
        command in `active` (each command's shortest first), so a large command shares the
        engine with those that arrive while it runs; finished commands leave `active`."""
        picks: list[tuple[_Work, int]] = []
        ahead = dict.fromkeys(map(id, active), 0)   # rows of each command in this forward
        width, taken = 0, True
        while taken:
            taken = False
            for work in active:
                row = work.peek(ahead[id(work)])
                if row is None:
                    continue
                longest = max(width, len(work.cmd.inputs[row]))
                if picks and longest * (len(picks) + 1) > BATCH_TOKENS:
                    taken = False
                    break
                picks.append((work, row))
                ahead[id(work)] += 1
                width, taken = longest, True
        try:
            vectors = self.vectors([w.cmd.inputs[row] for w, row in picks])
        except Exception as e:  # the boundary: these rows' commands fail, the engine goes on
            log.exception("embedding a batch of %d input(s) failed", len(picks))
            for work in {id(w): w for w, _ in picks}.values():
                work.cmd.error = ServeError(f"embedding failed ({type(e).__name__}); the server "
                                            "log has the details")
                self._finish(active, work)
            return
        for (work, row), vec in zip(picks, vectors):
            work.put(row, vec)
        for work in [w for w in active if w.complete]:
            work.cmd.result = work.vectors
            self._finish(active, work)

    def _finish(self, active: list[_Work], work: _Work) -> None:
        active.remove(work)
        self._num_done += 1
        answer(work.cmd.future, work.cmd.result, work.cmd.error)

    def vectors(self, inputs: list[list[int]]) -> list[list[float]]:
        """Engine thread. One padded forward: the library's pooled vector of each row."""
        import mlx.core as mx

        width = max(len(ids) for ids in inputs)
        ids = mx.array([row + [0] * (width - len(row)) for row in inputs])
        mask = mx.array([[1] * len(row) + [0] * (width - len(row)) for row in inputs])
        vec = self._output(self.loaded.model(ids, attention_mask=mask)).astype(mx.float32)
        mx.eval(vec)
        return vec.tolist()

    def _output(self, output: Any) -> Any:
        """A cross-encoder's scores; else the sentence embedding mlx-embeddings defines for
        the architecture."""
        if self.cfg.model.task.value == "rerank":
            return output.pooler_output
        vec = getattr(output, "text_embeds", None)
        return vec if vec is not None else output.pooler_output


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool, list,
                                                             dict, type(None)))}


def apply_reply(cmd: Embed, msg: dict[str, Any]) -> None:
    """A pool member's pipe reply (pipeserve/pool/proxy.py) back into the Embed's future."""
    if msg.get("error") is not None:
        cmd.error = decode_error(msg["error"])
    elif msg.get("vecs") is None:
        cmd.error = EngineUnavailable("the model's engine process stopped before it embedded "
                                      "the input; retry")
    else:
        cmd.result = msg["vecs"]
    answer(cmd.future, cmd.result, cmd.error)
