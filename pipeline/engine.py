"""Engine: the one thread that owns MLX — it loads the model, builds the step stages, and runs
the step loop. Public methods may be called from any thread; everything else is engine-only."""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from enum import Enum
from typing import Any

from pipeline.config import ServeConfig, build
from pipeline.errors import EngineUnavailable, ServeError, StageError
from pipeline.events import Abort, Event, Failed, Finished, Flush, Submit, TokenDelta
from pipeline.kv.attention import install as install_attention
from pipeline.kv.attention import on_cuda
from pipeline.kv.layouts import build_layout
from pipeline.loader import LoadedModel, load
from pipeline.memory import MemoryModel, probe
from pipeline.prompt_cache.ram import lend
from pipeline.metrics import Metrics
from pipeline.request import FinishReason, Request
from pipeline.scheduler import StepResult
from pipeline.stage import Batch, EngineContext, StepStage
from pipeline.stream import RequestStream, post_many

log = logging.getLogger(__name__)


class EngineState(Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class Engine:
    def __init__(self, cfg: ServeConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.state = EngineState.LOADING
        self.loaded: LoadedModel | None = None
        self.memory: MemoryModel | None = None
        self.kv_pool_bytes: int | None = None   # kv=paged: what the block pool holds
        self.startup_error: BaseException | None = None
        self.scheduler: Any = build(cfg.scheduler._target_, cfg)
        self._inbox: queue.SimpleQueue[Submit | Abort | Flush | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._outbox: list[tuple[RequestStream, Event]] = []   # flushed once per loop pass
        self._ready = threading.Event()
        self._stopping = False
        self._num_submitted = 0   # written by submitters only
        self._num_left_queue = 0  # written by the engine only: left the queue (ran or aborted)
        self._num_done = 0        # written by the engine only: finished or failed
        self._num_added = 0
        self._thread = threading.Thread(target=self._run, name="pipeserve-engine", daemon=True)

    # -- any thread -------------------------------------------------------------------
    def start(self) -> None:
        """Start loading in the engine thread; returns at once (see wait_ready)."""
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded or failed; True when ready."""
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet scheduled (inbox + scheduler queue)."""
        return self._num_submitted - self._num_left_queue

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the free batch slots: those that will really queue."""
        free = self.scheduler.max_batch - len(self.scheduler.running)
        return max(0, self.num_waiting - max(0, free))

    @property
    def num_inflight(self) -> int:
        return self._num_submitted - self._num_done

    def submit(self, request: Request, stream: RequestStream) -> None:
        if self.state is not EngineState.READY:
            raise EngineUnavailable(f"engine is {self.state.value}")
        self._num_submitted += 1
        self._inbox.put(Submit(request, stream))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def flush_cache(self) -> threading.Event:
        """Ask the engine to write every dirty prompt-cache entry; the returned event is set
        once they are all on disk (at once when there is nothing to write)."""
        done = threading.Event()
        if self.state is not EngineState.READY:
            done.set()
            return done
        self._inbox.put(Flush(done))
        return done

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            stages = self._load()
        except BaseException as e:  # the startup boundary: keep the error for start()'s caller
            log.exception("model load failed")
            self.startup_error = e
            self.state = EngineState.DEAD
            self._ready.set()
            return
        self.state = EngineState.READY
        self.metrics.engine_up.set(1)
        self._ready.set()
        try:
            self._loop(stages)
        except Exception as e:  # the engine cannot go on: fail everything in flight
            log.exception("engine loop died")
            self._die(e)
        finally:
            self._flush()
            self.metrics.engine_up.set(0)
            if hasattr(self.ctx.prompt_cache, "close"):
                self.ctx.prompt_cache.close()   # drains the SSD writer
            if self.state is EngineState.READY:
                self.state = EngineState.STOPPED

    def _load(self) -> list[StepStage]:
        import mlx.core as mx
        self.loaded = load(self.cfg.model)
        ctx = self.ctx = EngineContext(self.cfg, self.loaded, self.metrics)
        self.device = str(mx.default_device())
        ctx.layout = build_layout(self.cfg.kv, self.loaded.model)
        composed = self.cfg.model.composed_attention
        if ctx.layout.name != "dense" or (composed and on_cuda()):
            install_attention(self.loaded.model, composed_on_cuda=composed)
        if ctx.layout.name != "dense":
            from pipeline.kv import delayed
            per_row = max(1, len(ctx.layout.layers))   # called once per layer of a row
            delayed.on_convert = lambda _tokens: self.metrics.kv_conversions.inc(1 / per_row)
        self._setup_memory()
        if self.cfg.cache.name != "off":
            ctx.prompt_cache = build(self.cfg.cache._target_, self.cfg, self.metrics,
                                     self._cache_identity())
        ctx.layout.attach(ctx.prompt_cache)
        self.scheduler.on_admit = build(self.cfg.pipeline.cache_lookup._target_, self.cfg, ctx)
        self.scheduler.share_prefixes = ctx.prompt_cache is not None
        stages = [build(slot._target_, self.cfg, ctx)
                  for slot in self.cfg.pipeline.step_slots(self.cfg.draft.name != "none")]
        # labelled children resolved once, not per step
        self._stage_timers = {st.name: self.metrics.stage_seconds.labels(st.name) for st in stages}
        self._decode_tokens = self.metrics.step_tokens.labels("decode")
        self._prefill_tokens = self.metrics.step_tokens.labels("prefill")
        self.persist = next(s for s in stages if s.name == "persist")
        return stages

    def _cache_identity(self) -> str:
        """What makes stored KV reusable: same weights, KV layout and dtype, numerics
        (MLX version, device), tokenizer and adapters."""
        import mlx.core as mx
        loaded = self.loaded
        h = hashlib.sha256()
        for f in sorted(loaded.path.glob("tokenizer*")) + sorted(loaded.path.glob("*.model")):
            h.update(f.name.encode() + f.read_bytes())
        parts = [loaded.fingerprint, self.ctx.layout.identity, loaded.compute_dtype, mx.__version__,
                 str(mx.default_device()), h.hexdigest()[:16], "adapters="]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def _setup_memory(self) -> None:
        import mlx.core as mx
        adm = self.cfg.admission
        if adm.memory_budget_gb is not None:
            mx.set_memory_limit(int(adm.memory_budget_gb * 1e9))
        self.memory = probe(self.loaded, self.cfg.scheduler.prefill_chunk, adm.memory_budget_gb,
                            self.ctx.layout)
        kv_budget = int(adm.kv_budget_gb * 1e9) if adm.kv_budget_gb is not None else None
        pool = self.kv_pool_bytes = self.ctx.layout.pool_bytes
        if pool is not None:   # kv=paged: rows wait in the queue rather than exhaust the pool
            kv_budget = pool if kv_budget is None else min(kv_budget, pool)
        self.scheduler.set_memory(self.memory, kv_budget)
        m = self.metrics
        m.weight_bytes.set(self.memory.weight_bytes)
        m.kv_bytes_per_token.set(self.memory.kv_bytes_per_token)
        m.max_safe_context.set(self.memory.max_safe_context)
        m.context_cap.set(self.memory.max_safe_context if self.memory.enforced else float("nan"))
        m.kv_budget.set(kv_budget if kv_budget is not None else float("nan"))
        m.kv_reserved.set(0)
        log.info("memory: weights %.1f MB, KV %d B/token, max safe context %d tokens (%s)",
                 self.memory.weight_bytes / 1e6, self.memory.kv_bytes_per_token,
                 self.memory.max_safe_context, "enforced" if self.memory.enforced else "advisory")

    def _loop(self, stages: list[StepStage]) -> None:
        import mlx.core as mx
        sched = self.scheduler
        pending: Batch | None = None   # last step, queued on the device, not yet read back
        steps = 0
        self._sample_memory()
        cache = self.ctx.prompt_cache
        ticking = hasattr(cache, "tick")
        while not self._stopping:
            idle = pending is None and not sched.has_work()
            if idle:
                self._sample_memory()
                if ticking:
                    cache.tick()
            self._drain_inbox(block=idle, timeout=1.0 if ticking else None)
            if self._stopping:
                break
            batch = sched.schedule()
            self._count_waiting()
            self._replay(sched.running)
            if batch is not None:
                try:
                    self._run_stages(stages, batch)
                    mx.async_eval(batch.outputs())
                except Exception as e:  # a step failure fails that batch only
                    self._fail_batch(batch, e)
                    batch = None
            if batch is not None and batch.failed:   # rows that failed on their own
                self._fail_rows(batch)
            if pending is not None:
                self._update(pending)
            if batch is not None and batch.sync:   # structured output (Batch.sync): the next
                self._update(batch)                # step's mask needs these tokens: no pipelining
                batch = None
            self._flush()
            pending = batch if batch is not None and batch.sample_rows else None
            steps += 1
            if steps % 256 == 0:
                mx.clear_cache()
            if steps % 16 == 0:
                self._sample_memory()
        self._sample_memory()

    def _run_stages(self, stages: list[StepStage], batch: Batch) -> None:
        m = self.metrics
        m.batch_size.observe(batch.size)
        for stage in stages:
            t0 = time.perf_counter()
            stage(batch)
            self._stage_timers[stage.name].observe(time.perf_counter() - t0)
        decode = prefill = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.batch_size_max = max(req.batch_size_max, batch.size)
            if req.num_computed_tokens > req.num_prompt_tokens - 1:
                decode += n
            else:
                prefill += n
        if decode:
            self._decode_tokens.inc(decode)
        if prefill:
            self._prefill_tokens.inc(prefill)

    def _update(self, batch: Batch) -> None:
        try:
            if batch.emitted is not None:   # a verify step: tokens are on the host already
                result = StepResult(batch.emitted, batch.emitted_logprobs, batch.emitted_top)
            else:
                result = StepResult.single(
                    batch.sampled_ids.tolist(),
                    batch.logprobs.tolist() if batch.logprobs is not None else None,
                    [list(zip(i, v)) for i, v in zip(batch.top_ids.tolist(),
                                                     batch.top_logprobs.tolist())]
                    if batch.top_ids is not None else None)
        except Exception as e:
            self._fail_batch(batch, e)
            return
        now = time.perf_counter()
        finished: list[Request] = []
        for req, event in self.scheduler.update(batch, result):
            if isinstance(event, TokenDelta):
                if req.first_token_s is None:
                    req.first_token_s = now
                    self.metrics.ttft.observe(now - req.arrival_s)
                else:
                    self.metrics.itl.observe(now - req.last_token_s)
                req.last_token_s = now
            else:
                finished.append(req)
            self._post(req.request_id, event)
        self._retire(finished)
        self._checkpoint()
        self.metrics.active_rows.set(len(self.scheduler.running))
        self.metrics.kv_reserved.set(self.scheduler.kv_reserved)

    def _post(self, request_id: str, event: TokenDelta | Finished | Failed) -> None:
        stream = self._streams.get(request_id)
        if isinstance(event, (Finished, Failed)):
            self._streams.pop(request_id, None)
            self._num_done += 1
            if isinstance(event, Finished):
                self.metrics.generation_tokens.inc(event.num_output_tokens)
                self.metrics.prompt_tokens.inc(event.num_prompt_tokens)
                self.metrics.cached_tokens.inc(event.num_cached_tokens)
        if stream is not None:
            self._outbox.append((stream, event))

    def _flush(self) -> None:
        if self._outbox:
            post_many(self._outbox)
            self._outbox = []

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                cmd = self._inbox.get(block=block, timeout=timeout if block else 0)
            except queue.Empty:
                return
            block = False
            if cmd is None:
                return
            if isinstance(cmd, Flush):
                cmd.reply(self._flush_cache())
            elif isinstance(cmd, Submit):
                self._streams[cmd.request.request_id] = cmd.stream
                self.scheduler.add(cmd.request)
                self._num_added += 1
            else:
                req = self.scheduler.abort(cmd.request_id)
                if req is not None:
                    self._retire([req])
                    self._post(req.request_id, Finished(
                        req.request_id, cmd.reason, req.num_prompt_tokens, len(req.output_ids),
                        extras={"batch_size_max": req.batch_size_max}))
            self._count_waiting()

    def _replay(self, running: list[Request]) -> None:
        """Send resumed requests the output their checkpoint already holds."""
        for req in running:
            if req.replay_ids:
                req.first_token_s = req.last_token_s = time.perf_counter()
                self._post(req.request_id, TokenDelta(req.request_id, req.replay_ids))
                req.replay_ids = None

    def _checkpoint(self) -> None:
        """cache.checkpoint_every: snapshot rows that emitted N more tokens (host copies here,
        disk writes on the SSD writer thread)."""
        ckpt = getattr(self.ctx.prompt_cache, "checkpoints", None)
        if ckpt is None:
            return
        for req in self.scheduler.running:
            if req.in_prefill or not ckpt.due(req):
                continue
            caches = self.persist.row_caches(req)
            if caches is None:
                continue
            state = req.row_state
            key = None
            if state is not None:   # the key the next unseen token will be sampled with
                ahead = req.num_scheduled_outputs > len(req.output_ids)
                key = (state.prev_key if ahead and state.prev_key is not None
                       else state.key).tolist()
            ckpt.save(req, [lend(c) for c in caches], key)

    def _retire(self, finished: list[Request]) -> None:
        """Persist what finished rows computed, then free their KV."""
        ckpt = getattr(self.ctx.prompt_cache, "checkpoints", None)
        for req in finished:   # completion removes the checkpoint; a client cancel keeps it
            if ckpt is not None and req.checkpointed_tokens and req.finish_reason in (
                    FinishReason.STOP, FinishReason.LENGTH):
                ckpt.drop(req)
        if finished:
            self.persist.finished(finished)
            for req in finished:
                if self.ctx.proposer is not None:
                    self.ctx.proposer.release(req)
                self.scheduler.release(req)
        self._free_row_kv()

    def _flush_cache(self) -> threading.Event | None:
        cache = self.ctx.prompt_cache
        if not hasattr(cache, "flush"):
            return None
        t0 = time.perf_counter()
        done = cache.flush()
        log.info("prompt cache flush: entries handed to the SSD writer in %.3f s",
                 time.perf_counter() - t0)
        return done

    def _free_row_kv(self) -> None:
        if self.ctx.row_batch is not None:
            self.ctx.row_batch.drop_finished()

    def _count_waiting(self) -> None:
        waiting = len(self.scheduler.waiting)
        self._num_left_queue = self._num_added - waiting
        self.metrics.queue_depth.set(waiting)
        self.metrics.kv_reserved.set(self.scheduler.kv_reserved)

    def _fail_rows(self, batch: Batch) -> None:
        """Rows a step stage failed on their own (their sampling settings, grammar or draft;
        `Batch.failed`): each request fails alone, the rest of the step goes on, and the
        failed rows' outputs (placeholders) are never read."""
        for row, cause in batch.failed.items():
            req = batch.requests[row]
            if isinstance(cause, ServeError):   # a client-facing reason (a grammar that broke)
                log.warning("request %s failed in its step: %s", req.request_id, cause.message)
                err = cause
            else:
                log.error("request %s failed in its step", req.request_id, exc_info=cause)
                err = StageError("step", [req.request_id], cause)
            self._fail_request(req, err)
        self._free_row_kv()

    def _fail_batch(self, batch: Batch, cause: Exception) -> None:
        """The step itself failed (the forward, or work shared by its rows): none of its rows
        can be trusted, so each fails with a 503 its client may retry; the loop goes on."""
        ids = [r.request_id for r in batch.requests]
        log.error("step failed for %d request(s): %s", len(ids), ", ".join(ids), exc_info=cause)
        if self.ctx.row_batch is not None:
            # a half-applied step leaves the shared KV unusable: its rows are in this batch
            self.ctx.row_batch.reset()
        for req in batch.requests:
            self._fail_request(req, EngineUnavailable(
                f"the engine step computing request {req.request_id} failed (an internal "
                "error, logged by the server); nothing after the tokens already sent was "
                "produced — retry the request", code="step_failed"))
        self._free_row_kv()

    def _fail_request(self, req: Request, err: ServeError) -> None:
        if self.scheduler.abort(req.request_id) is not None:
            req.finish_reason = FinishReason.ERROR   # its KV is not kept
            if self.ctx.proposer is not None:
                self.ctx.proposer.release(req)
            self.scheduler.release(req)
            self._post(req.request_id, Failed(req.request_id, err))

    def _die(self, cause: Exception) -> None:
        self.state = EngineState.DEAD
        err = EngineUnavailable("the engine stopped after an internal error (logged by the "
                                "server); retry when /health answers 200")
        for req in self.scheduler.fail_all():
            self.scheduler.release(req)
            self._post(req.request_id, Failed(req.request_id, err))
        self._flush()

    def _sample_memory(self) -> None:
        import mlx.core as mx
        layout = self.ctx.layout
        held = self.ctx.row_batch.nbytes if self.ctx.row_batch is not None else 0
        for req in self.scheduler.running:
            if req.cache is not None:
                held += sum(c.nbytes for c in req.cache)
        self.metrics.kv_bytes.labels(layout.name).set(held)
        for state, n in layout.stats().items():
            self.metrics.kv_pool_blocks.labels(state).set(n)
        self.metrics.mlx_memory.labels("active").set(mx.get_active_memory())
        self.metrics.mlx_memory.labels("cache").set(mx.get_cache_memory())
        self.metrics.mlx_memory.labels("peak").set(mx.get_peak_memory())


__all__ = ["Engine", "EngineState", "ServeError"]
