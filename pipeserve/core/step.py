"""One engine step, readable top to bottom: the typed stage calls over a StepPlan and the row
store, each timed, and the host read-back of what they produced. Built on the engine thread
once the model is loaded; holds the step stages and the one RowStore (every row's KV)."""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx

from pipeserve.config import ServeConfig, build
from pipeserve.distributed.shard import sharding
from pipeserve.core.forward import Forward
from pipeserve.grammar.rows import catch_up
from pipeserve.kv.attention import install as install_attention
from pipeserve.kv.attention import on_cuda
from pipeserve.kv.layouts import build_layout
from pipeserve.core.rows import RowStore
from pipeserve.model.loader import LoadedModel, load
from pipeserve.memory import MemoryModel, setup_memory
from pipeserve.metrics import Metrics
from pipeserve.core.plan import NO_DRAFTS, Logits, RowOutput, Sampled, StepOutput, StepPlan
from pipeserve.prompt_cache.config import RAM_FLOOR_GB
from pipeserve.prompt_cache.protocol import reserve
from pipeserve.prompt_cache.ram import PromptCache, fit_ram_bytes
from pipeserve.request import Request
from pipeserve.core.sampler_states import SamplerStates
from pipeserve.core.scheduler import Limits
from pipeserve.core.stage import Ledger, StageDeps

log = logging.getLogger(__name__)
T = TypeVar("T")
PERSIST_ROWS = 8   # waiting prompt copies made per loop pass (pipeserve/stages/persist.py)


def first_tokens(rows: Sequence[Request]) -> bool:
    """Whether most of a step's rows sample their first token (a burst that was just
    prefilled): its tokens are read back before the next step is built, so they go out that
    launch's host time sooner (18-21 ms for 128 rows on an H100, once a burst); a step with a
    few new rows among many stays pipelined."""
    new = sum(1 for r in rows if not r.output_ids)
    return new > 0 and 2 * new >= len(rows)


@dataclass(slots=True)
class Launched:
    """A step whose forward is queued on the device: `sampled` (lazy, read back later: the
    next step may be planned first) or `output` (a verify step: already on the host).
    `failed`: rows whose grammar could not take their output (they fail with the step)."""

    plan: StepPlan
    logits: Logits
    sampled: Sampled | None = None
    output: StepOutput | None = None
    sync: bool = False
    queued: list[Any] | None = None   # arrays not yet handed to the device (Step.dispatch)
    failed: dict[str, BaseException] | None = None

    @property
    def samples(self) -> bool:
        return bool(self.logits.order)


class Step:
    def __init__(self, cfg: ServeConfig, loaded: LoadedModel, metrics: Metrics, layout: Any,
                 prompt_cache: PromptCache | None, ledger: Ledger) -> None:
        self.samplers = SamplerStates()   # every row's sampling state (sample, persist)
        self._metrics, self._layout, self._cache, self._steps = metrics, layout, prompt_cache, 0
        self._ticking = prompt_cache is not None and prompt_cache.idle_work
        self._ledger = ledger
        deps = StageDeps(cfg, loaded, metrics, layout, prompt_cache, self.samplers, ledger)
        slots = cfg.pipeline
        # a verify's rollback replays kept tokens of recurrent layers through the target
        self.kv = RowStore(lambda: layout.make_cache(loaded.model), Forward(loaded.model).feed)
        self.lookup = build(slots.cache_lookup._target_, cfg, deps)
        self.prefill = build(slots.prefill._target_, cfg, deps)
        self.sample = build(slots.sample._target_, cfg, deps)
        self.persist = build(slots.persist._target_, cfg, deps)
        speculative = cfg.draft.enabled
        self.draft = build(slots.draft._target_, cfg, deps) if speculative else None
        self.verify = (build(slots.verify._target_, cfg, deps, self.sample)   # picks with it
                       if speculative else None)
        self.prefill_chunk = cfg.scheduler.prefill_chunk
        self.bind_metrics()
        self.caching = prompt_cache is not None   # off: persist puts nothing (kernel warm-up)
        # the engine loop calls dispatch (unset: on a GPU)
        self.dispatch_late = cfg.scheduler.late_dispatch(
            on_gpu=mx.default_device().type == mx.DeviceType.gpu)

    def _room(self, plan: StepPlan, rid: str, hit: int) -> int:
        """Tokens a hit row's KV makes room for: up to its next prompt-chunk boundary (the
        scheduler aligns chunks after a hit to it), never past its prompt's own 256-token step
        (a short prompt's row stays the size of a cold one). Just the hit when its planned
        chunk is the rest of its prompt (or it has none this step): a prefill group copies
        the lent views once, into its batch buffer with room for the chunk (a reserve here
        made that a third copy, with the group's growth); a row prefilled alone gets its room
        where it is fed (RowStore.own); a row with no chunk joins the decode batch, whose
        merge copies it anyway."""
        row = next((r for r in plan.rows if r.request_id == rid), None)
        if row is None:
            return hit
        prompt = row.request.num_prompt_tokens
        if hit >= prompt - 1 or row.start + row.num_tokens >= prompt - 1:
            return hit
        chunk = self.prefill_chunk
        return min(-(-hit // chunk) * chunk, -(-prompt // 256) * 256)

    def bind_metrics(self) -> None:
        """Take the metric children the hot path observes (again after Metrics.muted)."""
        names = ["draft", "prefill", "sample", "verify", "persist"]
        self._timers = {n: self._metrics.stage_seconds.labels(n) for n in names}
        self._tokens = {p: self._metrics.step_tokens.labels(p) for p in ("decode", "prefill")}
        self._batch_size = self._metrics.batch_size

    def _timed(self, name: str, call: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self._timers[name].observe(time.perf_counter() - t0)

    def launch(self, plan: StepPlan) -> Launched:
        """draft → prefill (the forward) → sample | verify; queues the result on the device."""
        kv = self.kv
        for rid, hit in plan.hits:
            kv.adopt(rid, reserve(hit.caches, self._room(plan, rid, hit.num_tokens)))
            if hit.key is not None:   # a checkpoint resume: its sampler stream goes on
                self.samplers.resume(rid, hit.key)
        failed = catch_up(r.request for r in plan.decode)   # grammars take the applied output
        drafts = NO_DRAFTS
        if self.draft is not None and plan.decode:
            drafts = self._timed("draft", lambda: self.draft(plan, kv))
            plan = plan.with_drafts(drafts)
        logits = self._timed("prefill", lambda: self.prefill(plan, kv))
        for rid, cause in logits.failed.items():   # a row whose own prompt chunk raised
            failed.setdefault(rid, cause)
        self._count(plan)
        by_id = {r.request_id: r.request for r in plan.rows}
        rows = [by_id[rid] for rid in logits.order]
        if plan.has_drafts:
            if self.caching:
                self._timed("persist", lambda: self.persist.prompts(plan, kv))
            output = self._timed("verify", lambda: self.verify(logits, plan, rows, kv))
            kv.set_next(logits.order, mx.array([output.rows[rid].token_ids[-1]
                                                for rid in logits.order], dtype=mx.uint32))
            return Launched(plan, logits, output=output, sync=True, failed=failed)
        sampled = self._timed("sample", lambda: self.sample(logits, rows))
        launched = Launched(plan, logits, sampled,
                            sync=sampled.sync or drafts.sync or first_tokens(rows),
                            failed=failed)
        if rows:
            kv.set_next(sampled.order, sampled.token_ids)
            launched.queued = sampled.arrays()
            if not self.dispatch_late:
                self.dispatch(launched)
        # the finished prompts' cache copies queue behind the step's own work: the first
        # tokens never wait for them (sampling reads the caches, never writes them)
        if self.caching:
            self._timed("persist", lambda: self.persist.prompts(plan, kv))
        return launched

    @staticmethod
    def dispatch(launched: Launched) -> None:
        """Hand the step's queued arrays to the device (mx.async_eval); at most once."""
        if launched.queued is not None:
            arrays, launched.queued = launched.queued, None
            mx.async_eval(arrays)

    def _count(self, plan: StepPlan) -> None:
        self._batch_size.observe(len(plan.rows))
        decode = sum(r.width for r in plan.decode)
        prefill = plan.num_tokens - decode
        if decode:
            self._tokens["decode"].inc(decode)
        if prefill:
            self._tokens["prefill"].inc(prefill)

    @staticmethod
    def read(launched: Launched) -> StepOutput:
        """The step's results on the host (waits for the device)."""
        out = Step._read(launched)
        for rid, cause in (launched.failed or {}).items():
            out.failed.setdefault(rid, cause)
        return out

    @staticmethod
    def _read(launched: Launched) -> StepOutput:
        if launched.output is not None:
            return launched.output
        Step.dispatch(launched)
        s = launched.sampled
        out = StepOutput(failed=dict(s.failed) if s is not None else {})
        if s is None or not s.order:
            return out
        ids = s.token_ids.tolist()
        lps = s.logprobs.tolist() if s.logprobs is not None else None
        top = ([list(zip(i, v)) for i, v in zip(s.top_ids.tolist(), s.top_logprobs.tolist())]
               if s.top_ids is not None else None)
        for i, rid in enumerate(s.order):
            out.rows[rid] = RowOutput([ids[i]], [lps[i]] if lps else None,
                                      [top[i]] if top else None)
        return out

    def settle(self, launched: Launched, output: StepOutput | None) -> None:
        if self.draft is not None:
            self.draft.settle(launched.plan, launched.logits, output)

    def retire(self, finished: list[Request], running: list[Request]) -> None:
        """Persist what finished rows computed (and due checkpoints), then free their KV.
        Their output is already out: a persist that fails (the device out of memory) costs
        only these cache entries, never the engine or another row."""
        try:
            if self.caching:
                self._timed("persist", lambda: self.persist(finished, running, self.kv))
        except Exception:
            log.exception("persist failed; %d finished row(s) are not cached", len(finished))
        if finished:
            self.kv.release_many([req.request_id for req in finished])   # one batch filter
            for req in finished:
                self._release_state(req)

    def evict(self, req: Request, keep: bool = True) -> None:
        """A row the scheduler preempts: what it computed goes into the prompt cache (so its
        readmission is a hit; not with `keep` false: KV a failed step left untrusted), then its
        KV and row state are freed; its sampler stream goes on at readmission from the key of
        its first token not applied yet (a seeded sampled row's output equals its unpreempted
        run). A persist that fails costs only the recompute."""
        try:
            if self.caching and keep:
                self._timed("persist", lambda: self.persist.keep(req, self.kv))
        except Exception:
            log.exception("persist failed; preempted row %s computes its KV again",
                          req.request_id)
        rid = req.request_id
        key = self.samplers.checkpoint_key(rid, self._ledger.outputs_ahead(rid) > 0)
        self.release(req)
        if key is not None:
            self.samplers.resume(rid, key)

    def free_cached(self) -> int:
        """Device memory held for later, given back: every prompt-cache entry (spilled to the
        SSD tier where there is one) and MLX's cached buffers. Returns the entries dropped."""
        dropped = 0
        while self._cache is not None and self._cache.evict_oldest():
            dropped += 1
        mx.clear_cache()
        return dropped

    def release(self, req: Request) -> None:
        self.kv.release(req.request_id)
        self._release_state(req)

    def _release_state(self, req: Request) -> None:
        if self.draft is not None:
            self.draft.release(req)
        self.samplers.release(req.request_id)

    # -- between steps ------------------------------------------------------------------
    @property
    def idle_wait_s(self) -> float | None:
        """How long an idle engine waits for a command before `idle` runs again (None: until
        one comes; a prompt cache with idle work, the SSD tier's demotion, wants 1 s)."""
        return 1.0 if self._ticking else None

    def idle(self) -> None:
        """Nothing to run: memory gauges, and the prompt cache's idle work."""
        sample_memory(self._metrics, self.kv, self._layout)
        if self.draft is not None:
            self.draft.idle()
        if self._ticking:
            self._cache.tick()

    def between(self, busy: bool, plan: StepPlan | None) -> None:
        """After a pass's tokens are out: a few waiting prompt copies, while the device runs
        the step in flight (`busy`). Never in a pass that prefilled with no step in flight:
        its rows' first step comes next, and the copies would delay those first tokens."""
        if self.caching and (busy or plan is None or all(r.samples for r in plan.rows)):
            self._timed("persist", lambda: self.persist.drain(self.kv, PERSIST_ROWS))

    def forget_timings(self) -> None:
        """The kernel warm-up is over: what its steps took says nothing of the traffic."""
        if self.draft is not None:
            self.draft.forget_timings()

    def passed(self) -> None:
        """After each loop pass: memory gauges every 16th, MLX's buffer cache back every 256th."""
        self._steps += 1
        if self._steps % 256 == 0:
            mx.clear_cache()
        if self._steps % 16 == 0:
            sample_memory(self._metrics, self.kv, self._layout)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()   # drains the SSD writer


@dataclass(slots=True)
class Parts:
    """What the engine thread builds at load, in order."""

    loaded: LoadedModel
    device: str
    layout: Any
    memory: MemoryModel
    kv_pool_bytes: int | None
    prompt_cache: PromptCache | None
    step: Step


def load_parts(cfg: ServeConfig, metrics: Metrics, scheduler: Any) -> Parts:
    """Load the model, build its KV layout (and attention), fit the scheduler to the device
    and the memory model, build the prompt cache and the step."""
    loaded = load(cfg.model, shard=sharding(cfg))   # None unless distributed≠none
    if loaded.experts is not None:   # model.expert_offload: its hot-expert cache counted
        metrics.watch_experts(loaded.experts)
    layout = build_layout(cfg.kv, loaded.model, on_convert=metrics.kv_conversions.inc)
    composed = cfg.model.composed_attention
    limits = Limits.fit(cfg, on_gpu=mx.default_device().type == mx.DeviceType.gpu)
    if layout.own_attention or (composed and on_cuda()):
        install_attention(loaded.model, composed_on_cuda=composed,
                          compose_decode=cfg.model.composed_decode,
                          prefill_chunk=limits.prefill_chunk)
    memory, kv_budget, pool = setup_memory(cfg, loaded, layout, metrics, limits.prefill_chunk)
    prompt_cache = None
    if cfg.cache.enabled:
        # every rank of a distributed group must keep the same entries: a size fitted to each
        # rank's own device could differ, so the group keeps the fixed one unless it is set
        fixed = cfg.cache.ram_gb is None and cfg.distributed.enabled
        ram_bytes, why = fit_ram_bytes(RAM_FLOOR_GB if fixed else cfg.cache.ram_gb, memory)
        why = "fixed in a distributed group" if fixed else why
        prompt_cache = build(cfg.cache._target_, cfg, metrics, cache_identity(loaded, layout),
                             max_bytes=ram_bytes)
        log.info("prompt cache: %s, RAM tier %.1f GiB (%s; %d tokens of KV)", cfg.cache.name,
                 ram_bytes / (1 << 30), why, ram_bytes // max(memory.kv_bytes_per_token, 1))
    layout.attach(prompt_cache)
    step = Step(cfg, loaded, metrics, layout, prompt_cache, scheduler)
    # with a prompt cache, admission looks each request up (and may wait for a shared prefix)
    # after setup_memory: MLX's limit as configured; a paged pool (allocated whole at load)
    # already bounds what rows take, and its rows add nothing to MLX's active memory
    high = cfg.admission.memory_high_water
    ceiling = (int(high * mx.get_memory_limit())
               if high > 0 and pool is None and mx.get_memory_limit() else None)
    scheduler.configure(limits, memory, kv_budget,
                        lookup=step.lookup if prompt_cache is not None else None,
                        evict=step.evict, copying=step.persist.waiting,
                        min_reuse=getattr(step.lookup, "min_reuse", 0),
                        active_memory=mx.get_active_memory, memory_ceiling=ceiling,
                        reclaim=prompt_cache.evict_oldest if prompt_cache is not None else None)
    log.info("scheduler: up to %d rows, %d tokens per step (prompt chunks of %d)%s",
             limits.max_batch, limits.max_num_batched_tokens, limits.prefill_chunk,
             f"; new rows wait while MLX's active memory would pass {ceiling / 1e9:.1f} GB"
             if ceiling else "")
    return Parts(loaded, str(mx.default_device()), layout, memory, pool, prompt_cache, step)


def cache_identity(loaded: LoadedModel, layout: Any) -> str:
    """What makes stored KV reusable: same weights, KV layout and dtype, numerics (MLX
    version, device), tokenizer and adapters."""
    h = hashlib.sha256()
    for f in sorted(loaded.path.glob("tokenizer*")) + sorted(loaded.path.glob("*.model")):
        h.update(f.name.encode() + f.read_bytes())
    parts = [loaded.fingerprint, layout.identity, loaded.compute_dtype, mx.__version__,
             str(mx.default_device()), h.hexdigest()[:16],
             "adapters=" + _adapters_identity(loaded)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _adapters_identity(loaded: LoadedModel) -> str:
    """The launch default's id@digest (what a launch of one adapter keys by), then every other
    mounted one."""
    default = loaded.adapter.identity if loaded.adapter is not None else ""
    if loaded.adapters is None:
        return default
    others = [a.identity for a in loaded.adapters.adapters.values() if a is not loaded.adapter]
    return ",".join([default] + others) if others else default


def sample_memory(metrics: Metrics, kv: RowStore, layout: Any) -> None:
    metrics.kv_bytes.labels(layout.name).set(kv.nbytes)
    for state, n in layout.stats().items():
        metrics.kv_pool_blocks.labels(state).set(n)
    metrics.mlx_memory.labels("active").set(mx.get_active_memory())
    metrics.mlx_memory.labels("cache").set(mx.get_cache_memory())
    metrics.mlx_memory.labels("peak").set(mx.get_peak_memory())
