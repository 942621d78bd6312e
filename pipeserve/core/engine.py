"""Engine: the one thread that owns MLX — it loads the model, builds the step stages, and runs
the step loop. Public methods may be called from any thread; everything else is engine-only."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pipeserve.adapters import swap as adapter_swap
from pipeserve.config import ServeConfig, build
from pipeserve.errors import ConfigError, EngineUnavailable, ServeError, row_failure, step_failed
from pipeserve.core.client import EngineLoad, EngineState
from pipeserve.core import kernel_prebuild, kernel_warmup, preempt
from pipeserve.core.inbox import Inbox
from pipeserve.core.limits import EngineLimits
from pipeserve.core.events import (Abort, AdapterSwap, Command, Failed, Flush, Settle, Submit,
                                   TokenDelta, answer)
from pipeserve.model.loader import LoadedModel
from pipeserve.memory import MemoryModel
from pipeserve.metrics import Metrics
from pipeserve.core.plan import StepPlan
from pipeserve.request import FinishReason, Request
from pipeserve.core.scheduler import Scheduler, finished_event
from pipeserve.core.scoring import Score
from pipeserve.core.step import Launched, load_parts
from pipeserve.core.step_trace import StepTrace
from pipeserve.launch.progress import StepProgress
from pipeserve.core.outbox import Outbox
from pipeserve.core.stream import RequestStream
from pipeserve.prompt_cache.protocol import rewinds

log = logging.getLogger(__name__)
MEMORY_LOG_S = 10.0   # the memory gate's log line, at most this often
OOM_CEILING = 0.85    # after a step ran out of device memory, the memory gate's ceiling times this
OOM_RETRIES = 3       # times a row may wait again after out-of-memory steps before it fails


__all__ = ["Engine", "EngineState"]


class Engine:
    """An EngineClient (core/client.py) whose engine thread runs in this process."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics,
                 on_death: Callable[[], None] | None = None) -> None:
        """`on_death`: called once, from the engine thread or abandon's caller, after the
        engine died while serving and failed what it held (the server's exit, http/drain.py)."""
        self.cfg, self.metrics, self.state = cfg, metrics, EngineState.LOADING
        self.on_death = on_death
        self.limits: EngineLimits | None = None   # published at load, again after a swap
        self.loaded: LoadedModel | None = None
        self.memory: MemoryModel | None = None
        self.kv_pool_bytes: int | None = None   # kv=paged: what the block pool holds
        self.startup_error: BaseException | None = None
        self.scheduler: Scheduler = build(cfg.scheduler._target_, cfg)
        self.prompt_cache: Any = None   # pipeserve.prompt_cache.*, or None (cache=off)
        self.layout: Any = None         # pipeserve.kv.layouts.*; the step: load_parts
        self._inbox, self._out = Inbox(), Outbox(metrics)
        self._arrivals = (0.0, 0.0)   # (gap, window) seconds an idle engine takes arrivals for
        self._oom_retried: dict[str, int] = {}   # rows that waited again after out-of-memory steps
        self._memory_logged, self._memory_waits = -MEMORY_LOG_S, 0   # the memory gate's log
        self._ready, self.stopping = threading.Event(), False   # stopping: leave the loop
        self._thread = threading.Thread(target=self._run, name="pipeserve-engine", daemon=True)
        self.group: Any = None   # distributed≠none: pipeserve/distributed/group.py, built at load

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
        return self._inbox.num_waiting

    @property
    def num_inflight(self) -> int:
        return self._inbox.num_submitted - self._out.num_done

    def load(self) -> EngineLoad:
        return EngineLoad.of(self.num_waiting, len(self.scheduler.running), self.num_inflight,
                             self.scheduler.max_batch)

    def submit(self, request: Request, stream: RequestStream) -> None:
        if self.state is not EngineState.READY:
            raise EngineUnavailable(f"engine is {self.state.value}")
        self._inbox.put(Submit(request, stream))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def coming(self) -> None:
        self._inbox.coming()

    def command(self, cmd: Any) -> Future[Any]:
        """Any thread: the engine runs `cmd` between steps (a Flush: every dirty prompt-cache
        entry written; its future is True once they are all on disk)."""
        if self.state is not EngineState.READY:
            answer(cmd.future, error=EngineUnavailable(f"engine is {self.state.value}"))
        else:
            self._inbox.put(cmd)
        return cmd.future

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._load()
            if kernel_warmup.enabled(self.cfg, on_gpu="gpu" in self.device):
                self._warm_kernels()   # a row that fails is logged; a loop that dies fails the start
        except BaseException as e:  # the startup boundary: keep the error for start()'s caller
            if not isinstance(e, ConfigError):   # a ConfigError is serve.py's one-line report
                log.exception("model load failed")
            self.startup_error = e
            self.state = EngineState.DEAD
            self._ready.set()
            return
        try:
            self.state = EngineState.READY
            self.metrics.engine_up.set(1)
            self._ready.set()
            self._loop()
        except Exception as e:  # the engine cannot go on: fail everything in flight
            log.exception("engine loop died")
            self._die(e)
        finally:
            self._refuse_left()
            self._out.flush()
            self.metrics.engine_up.set(0)
            self.step.close()   # the prompt cache drains its SSD writer
            if self.state is EngineState.READY:
                self.state = EngineState.STOPPED

    def _load(self) -> None:
        if self.cfg.distributed.enabled:   # every rank, before the model is sharded
            self.group = build(self.cfg.distributed._target_, self.cfg, self.metrics)
        p = load_parts(self.cfg, self.metrics, self.scheduler)
        self.loaded, self.device, self.layout, self.memory = p.loaded, p.device, p.layout, p.memory
        self.kv_pool_bytes, self.prompt_cache, self.step = p.kv_pool_bytes, p.prompt_cache, p.step
        s = self.cfg.scheduler
        self._arrivals = (s.arrival_gap_s(self.device), s.arrival_window_ms / 1000)
        self.publish()

    def publish(self) -> None:
        """Engine thread: the limits the HTTP side reads, replaced whole (at load, and after
        an adapter swap changed the mounted set)."""
        assert self.loaded is not None
        self.limits = EngineLimits.of(self.cfg, self.loaded, max_rows=self.scheduler.max_batch,
                                      memory=self.memory, kv_pool_bytes=self.kv_pool_bytes,
                                      device=self.device, rewinds=rewinds(self.loaded.model))

    def _warm_kernels(self) -> None:
        """Run the kernel warm-up's requests (core/kernel_warmup.py) through the loop, the prompt
        cache detached and the metrics muted; a failure is logged, never fatal. The long prompt
        runs first and alone, then the burst: the log says what each cost."""
        t0, lim = time.perf_counter(), self.scheduler.limits
        self._prebuild_kernels(lim.max_batch, lim.prefill_chunk)
        reqs = kernel_warmup.requests(self.limits.vocab_size, self.limits.max_context,
                                      lim.prefill_chunk, lim.max_batch)
        sinks = [kernel_warmup.Sink() for _ in reqs]
        sizes = [r.num_prompt_tokens + r.sampling.max_tokens for r in reqs]
        progress = StepProgress(log, "kernel warm-up", sum(sizes), unit="tokens")
        split = 1 if len(reqs) > 1 and reqs[0].request_id.endswith("long") else 0
        phases = [p for p in (range(split), range(split, len(reqs))) if len(p)]
        took: list[float] = []
        trace: list[tuple[float, int, int]] = []
        lookup, self.scheduler.lookup = self.scheduler.lookup, None
        self.step.caching = False
        try:
            with self.metrics.muted():
                self.step.bind_metrics()
                for phase in phases:
                    t1 = time.perf_counter()
                    for i in phase:
                        self._inbox.put(Submit(reqs[i], sinks[i]))

                    def until(phase: range = phase) -> bool:   # between steps
                        progress.advance(sum(n for n, s in zip(sizes, sinks) if s.finished)
                                         - progress.done)
                        return all(sinks[i].finished for i in phase)
                    self._loop(until=until, trace=trace)
                    took.append(time.perf_counter() - t1)
        finally:
            progress.close()
            self.scheduler.lookup, self.step.caching = lookup, self.step._cache is not None
            self.step.bind_metrics()
            self.step.forget_timings()   # draft.gate: the warm-up's steps built kernels
        errors = [s.error for s in sinks if s.error is not None]
        if errors:
            log.warning("kernel warm-up: %d of %d requests failed (%s); serving anyway",
                        len(errors), len(reqs), errors[0])
        parts = ([f"a {reqs[0].num_prompt_tokens}-token prompt {took[0]:.2f} s"] if split else []) \
            + ([f"a burst of {len(reqs) - split} {took[-1]:.2f} s"] if len(took) > split else [])
        slow = ", ".join(f"{t:.2f} s ({r} rows, {n} tokens)" for t, r, n in sorted(trace)[::-1][:6])
        log.info("kernel warm-up: %d requests (%s) in %.2f s; %d steps, slowest: %s", len(reqs),
                 ", ".join(parts), time.perf_counter() - t0, len(trace), slow)

    def _prebuild_kernels(self, max_rows: int, prefill_chunk: int) -> None:
        """On CUDA: the kernel modules a server meets first (a quantized model's matmuls, the
        sampler's and the embedding's gathers and scatters) built in parallel child processes
        first (core/kernel_prebuild.py), so the warm-up loads them instead of compiling them
        one after another."""
        assert self.loaded is not None
        dtype = self.loaded.compute_dtype.split("+")[0]
        if dtype not in ("bfloat16", "float16", "float32"):
            return
        specs = kernel_prebuild.quant_specs(self.loaded.model)
        rows = kernel_prebuild.row_classes(max_rows, prefill_chunk)
        try:
            rep = kernel_prebuild.prebuild(kernel_prebuild.matmul_jobs(specs, dtype, rows)
                                           + kernel_prebuild.indexing_jobs(dtype, bool(specs)))
        except OSError as e:   # the kernel cache unwritable, no process to spawn: the warm-up
            log.warning("kernel warm-up: no parallel kernel builds (%s)", e)   # builds them
            return
        if rep is None:
            return
        log.info("kernel warm-up: %d kernel builds in child processes in %.1f s, %d new "
                 "modules%s%s", rep.children, rep.seconds, len(rep.modules),
                 f" ({', '.join(rep.modules)})" if rep.modules else "",
                 f"; failed: {'; '.join(rep.failed)}" if rep.failed else "")

    def _loop(self, until: Callable[[], bool] | None = None,
              trace: list[tuple[float, int, int]] | None = None) -> None:
        """The step loop, until stopped (or, for the kernel warm-up, until `until()` with no step
        in flight; `trace` gets each pass's seconds, rows and tokens)."""
        sched = self.scheduler
        pending: Launched | None = None   # last step, queued on the device, not yet read back
        tr = StepTrace() if self.cfg.scheduler.step_trace and until is None else None
        taken: list[Command] = []
        while not self.stopping:
            t_pass = time.perf_counter()
            if until is not None and pending is None and until():
                return
            idle = pending is None and not sched.has_work()
            if idle:
                self.step.idle()
            if tr is not None:
                tr.begin()
            if self.group is not None:   # every rank runs rank 0's plan (pipeserve/distributed)
                plan = self.group.next_plan(self, idle)
            else:
                taken = self.take_commands(block=idle, timeout=self.step.idle_wait_s)
                if tr is not None:
                    tr.mark("inbox")
                plan = None if self.stopping else sched.schedule()
            if tr is not None:
                tr.mark("schedule")
            if self.stopping:
                break
            if sched.preempted:
                self._preempted()
            if sched.memory_held:
                self._memory_held()
            self._count_waiting()
            self._out.replay(sched.running)
            launched = None
            held: Callable[[], None] | None = None
            if plan is not None and pending is not None and plan.prefill:
                # a prompt chunk's forward is evaluated inside launch: the step in flight posts
                # its tokens (first tokens among them) first instead of waiting for the chunk;
                # the rows it ended leave after the launch (this plan was made with them)
                held = self._apply(pending)
                pending = None
                self._out.flush()
                if tr is not None:
                    tr.mark("apply_before")
            if plan is not None:
                try:
                    launched = self.step.launch(plan)
                except Exception as e:  # a step failure fails that step's rows only
                    self._fail_plan(plan, e)
                if tr is not None:
                    tr.mark("launch")
            if held is not None:
                held()
            # the rows a step ended are retired (their KV stored, then freed) once its events
            # are out: a client's last tokens and finish never wait for that bookkeeping
            if pending is not None:
                self._retire_after_flush(self._apply(pending))
                if tr is not None:
                    tr.mark("apply")
            if launched is not None and (launched.sync or not launched.samples):
                self._retire_after_flush(self._apply(launched))   # the next plan needs these
                launched = None                                     # results: no pipelining
                if tr is not None:
                    tr.mark("apply_now")
            self._out.flush()
            if launched is not None:
                self.step.dispatch(launched)   # scheduler.dispatch_late: only now
            self.step.between(launched is not None, plan)
            if tr is not None:
                tr.mark("drain")   # waiting prompt copies (Step.between), apart from the rest
            pending = launched
            self.step.passed()
            if trace is not None and plan is not None:
                trace.append((time.perf_counter() - t_pass, len(plan.rows), plan.num_tokens))
            if tr is not None and plan is not None:
                tr.end(len(plan.rows), len(plan.prefill),
                       sum(r.width for r in plan.prefill), len(taken))
        if self.group is not None:   # rank 0 tells the group it stops (pipeserve/distributed)
            self.group.leave(self)

    def _retire_after_flush(self, end: Callable[[], None] | None) -> None:
        self._out.flush()
        if end is not None:
            end()

    def _apply(self, launched: Launched) -> Callable[[], None] | None:
        """Read a step's results back and apply them: their events are posted; the rows that
        ended (finished or failed) keep their KV until the returned call retires them."""
        try:
            output = self.step.read(launched)
        except Exception as e:
            self._fail_plan(launched.plan, e)
            return None
        now = time.perf_counter()
        finished: list[Request] = []
        for req, event in self.scheduler.update(launched.plan, output):
            if isinstance(event, TokenDelta):
                self._out.tokens(req, event, now)
            else:
                finished.append(req)
                self._out.post(req.request_id, event)
        self.step.settle(launched, output)

        def end() -> None:
            for rid, cause in output.failed.items():   # rows a stage failed on their own
                self._fail_request(rid, row_failure(rid, cause))
            self.step.retire(finished, self.scheduler.running)
            for req in finished:
                self.scheduler.release(req.request_id)
                self._oom_retried.pop(req.request_id, None)
            self.metrics.active_rows.set(len(self.scheduler.running))
            self.metrics.kv_reserved.set(self.scheduler.kv_reserved)
        return end

    def take_commands(self, block: bool, timeout: float | None = None) -> list[Command]:
        """Run every command in the inbox (waiting up to `timeout` for one when `block`);
        returns them, in order (rank 0 of a distributed group broadcasts them)."""
        gap, window = self._arrivals if block else (0.0, 0.0)   # an idle engine takes a burst whole
        done = list(self._inbox.take(block, timeout, gap, window))
        for cmd in done:
            self.run_command(cmd)
        return done

    def run_command(self, cmd: Command) -> None:
        """One inbox command, between steps (other ranks: the commands rank 0 broadcast)."""
        if isinstance(cmd, Flush):
            cmd.reply(self.prompt_cache.flush() if self.prompt_cache is not None else None)
        elif isinstance(cmd, Settle):
            answer(cmd.future, True)
        elif isinstance(cmd, AdapterSwap):   # hot-swap: pipeserve/adapters/swap.py
            adapter_swap.run(self, cmd)
        elif isinstance(cmd, Score):   # prompt scoring: pipeserve/core/scoring.py
            cmd.run(self)
        elif isinstance(cmd, Submit):
            self._out.open(cmd.request.request_id, cmd.stream)
            self.scheduler.add(cmd.request)
            self._inbox.num_added += 1
        elif (req := self.scheduler.abort(cmd.request_id, cmd.reason)) is not None:
            self._oom_retried.pop(req.request_id, None)
            self.step.retire([req], [])
            self.scheduler.release(req.request_id)
            self._out.post(req.request_id, finished_event(req))
        self._count_waiting()

    def _refuse_left(self) -> None:
        """The loop has ended: what is still in the inbox gets its answer (a 503), so no
        handler waits on a command, nor a stream on a request, the engine will never run."""
        err = EngineUnavailable("the engine stopped before it ran this; retry when /health "
                                "answers 200")
        for cmd in self._inbox.take(block=False, timeout=None):
            if isinstance(cmd, Submit):
                self._out.open(cmd.request.request_id, cmd.stream)
                self._out.post(cmd.request.request_id, Failed(cmd.request.request_id, err))
            elif not isinstance(cmd, Abort):
                answer(cmd.future, error=err)

    def _preempted(self) -> None:
        sched = self.scheduler
        self.metrics.preemptions.inc(len(sched.preempted))
        for req in sched.preempted:
            log.info("preempted %s (priority %d) at %d output tokens for a more urgent request",
                     req.request_id, req.priority, req.num_folded)
        sched.preempted.clear()

    def _memory_held(self) -> None:
        """Requests the memory gate held: counted; logged at most every MEMORY_LOG_S."""
        sched = self.scheduler
        self.metrics.memory_waits.inc(sched.memory_held)
        self._memory_waits += sched.memory_held
        sched.memory_held = 0
        now = time.monotonic()
        if now - self._memory_logged >= MEMORY_LOG_S:
            log.info("memory: %d request(s) waited for a row since the last such line: MLX's "
                     "active memory (%.1f GB) and their prompts' KV would pass %.1f GB "
                     "(admission.memory_high_water)", self._memory_waits,
                     sched.active_memory() / 1e9, sched.memory_ceiling / 1e9)
            self._memory_logged, self._memory_waits = now, 0

    def _count_waiting(self) -> None:
        self.metrics.queue_depth.set(self._inbox.still_waiting(len(self.scheduler.waiting)))
        self.metrics.kv_reserved.set(self.scheduler.kv_reserved)
        self.metrics.active_rows.set(len(self.scheduler.running))   # aborts leave it too

    def _fail_plan(self, plan: StepPlan, cause: Exception) -> None:
        """The step itself failed (the forward, or work shared by its rows): none of its rows,
        nor any row whose KV it shared, can be trusted, so each fails with a 503 its client
        may retry; the loop goes on."""
        if self.group is not None:   # a rank's collectives may be half done: the group stops
            self.group.fatal(cause)
        ids = list(dict.fromkeys([r.request_id for r in plan.rows] + self.step.kv.drop_shared()))
        again = (self._out_of_memory(ids, cause)
                 if self.group is None and preempt.out_of_memory(cause) else set())
        failed = [rid for rid in ids if rid not in again]
        if failed:
            log.error("step failed for %d request(s): %s", len(failed), ", ".join(failed),
                      exc_info=cause)
        for rid in failed:
            self._fail_request(rid, step_failed(rid))

    def _out_of_memory(self, ids: list[str], cause: Exception) -> set[str]:
        """The step ran out of device memory: the prompt cache's entries are dropped and
        MLX's cached buffers given back, the memory gate's ceiling is lowered, and each of the
        step's rows waits again (its output so far folded into its prompt, computed again, as
        a preemption): the client sees its stream go on, and the gate admits fewer rows at
        once. A row fails as any failed step's rows do when it cannot fold (a grammar, media),
        when it waited again OOM_RETRIES times already, or when it ran out again alone (no
        smaller step can hold it). Returns the rows that wait again."""
        sched = self.scheduler
        running = {r.request_id: r for r in sched.running}
        tries = self._oom_retried
        again = [running[rid] for rid in ids if rid in running and preempt.foldable(running[rid])
                 and tries.get(rid, 0) < OOM_RETRIES and not (len(ids) == 1 and rid in tries)]
        dropped = self.step.free_cached()
        before = sched.memory_ceiling
        if before is not None:
            sched.memory_ceiling = int(before * OOM_CEILING)
        for req in again:
            tries[req.request_id] = tries.get(req.request_id, 0) + 1
            self.step.evict(req, keep=False)   # the step's shared KV is not to be trusted
            sched.requeue(req)
        self.metrics.preemptions.inc(len(again))
        log.warning("step ran out of device memory (%s) with %d row(s): %d wait again and are "
                    "computed again, %d fail; %d prompt-cache entries dropped; %s", cause,
                    len(ids), len(again), len(ids) - len(again), dropped,
                    f"new rows now wait while MLX's active memory would pass "
                    f"{sched.memory_ceiling / 1e9:.1f} GB (was {before / 1e9:.1f}; "
                    f"admission.memory_high_water)" if before is not None else
                    "the memory gate is off (admission.memory_high_water=0 or a paged pool)")
        return {r.request_id for r in again}

    def _fail_request(self, rid: str, err: ServeError) -> None:
        self._oom_retried.pop(rid, None)
        req = self.scheduler.abort(rid, FinishReason.ERROR)   # its KV is not kept
        if req is not None:
            self.step.release(req)
            self.scheduler.release(rid)
            self._out.post(rid, Failed(rid, err))

    def abandon(self, cause: Exception) -> None:
        """Any thread, once the engine thread is stuck for good (a distributed rank is gone,
        pipeserve/distributed/group.py): fail what is in flight, answer 503 from now on."""
        log.error("engine abandoned: %s", cause)
        self._die(cause)

    def _die(self, cause: Exception) -> None:
        first = self.state is not EngineState.DEAD   # abandoned, then its loop raised too
        self.state = EngineState.DEAD
        err = EngineUnavailable("the engine stopped after an internal error (logged by the "
                                "server); retry when /health answers 200")
        for req in self.scheduler.fail_all():
            self._out.post(req.request_id, Failed(req.request_id, err))
        self._out.flush()
        if first and self.on_death is not None:
            self.on_death()
