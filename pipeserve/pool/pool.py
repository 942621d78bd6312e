"""ModelPool: the models of `pool=<name>` by id — routing a request's `model` to its member,
loading a member's engine process on first use (bounded by pool.load_timeout_s), evicting the
least recently used idle member beyond pool.max_resident, unloading members idle for
pool.idle_unload_s, and restarting one whose process died. Event loop (loads wait in the
executor)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from pipeserve.config import ServeConfig, config_hash
from pipeserve.core.client import EngineState
from pipeserve.errors import EngineUnavailable, NotFound
from pipeserve.http.front import Front
from pipeserve.metrics import Metrics
from pipeserve.pool import metrics as pool_metrics
from pipeserve.pool.config import PoolConfig
from pipeserve.pool.proxy import ChildEngine
from pipeserve.http.api.record import base_record
from pipeserve.pool.members import compose_member
from pipeserve.pool.scan import scan

log = logging.getLogger("pipeserve.pool")
ROOM_POLL_S = 0.05   # how often a load waiting for room looks for an idle model to evict


class Member:
    """One model of the pool, and the context its requests run in: the attributes the
    handlers read of `app.ctx` for a single model (cfg, engine, front, record, metrics,
    config_hash), per model."""

    def __init__(self, model_id: str, cfg: ServeConfig, app_ctx: Any) -> None:
        self.id, self.cfg, self.app_ctx = model_id, cfg, app_ctx
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)   # HTTP side: requests, latency, admission
        self.config_hash = config_hash(cfg)
        self.record = base_record(cfg, self.config_hash, None)
        self.engine: ChildEngine | None = None
        self.front: Any = None
        self.loading: asyncio.Task[None] | None = None
        self.last_used = time.monotonic()
        self.num_loads = 0
        self.weight_bytes = _weight_files_bytes(cfg)   # exact once it has loaded
        self.pins = 0   # requests routed here and not finished (Scope): never evicted under them
        self.admitted = False   # its load has made room (until then it holds no slot)
        self.keep_alive_s: float | None = None   # the last request's keep_alive; None: the pool's
        self.created = int(time.time())

    @property
    def draining(self) -> bool:
        return bool(getattr(self.app_ctx, "draining", False))

    @property
    def ready(self) -> bool:
        """Serving: its engine is up and its load finished (front and record are its own)."""
        return (self.loading is None and self.engine is not None
                and self.engine.state is EngineState.READY)

    @property
    def resident(self) -> bool:
        return self.ready or (self.loading is not None and self.admitted)

    @property
    def evictable(self) -> bool:
        return self.ready and self.num_inflight == 0 and self.pins == 0

    def release(self) -> None:
        """A request routed here (context(pin=True)) has finished."""
        self.pins -= 1
        self.last_used = time.monotonic()

    @property
    def num_inflight(self) -> int:
        return self.engine.load().num_inflight if self.engine is not None else 0

    def idle_s(self, now: float) -> float:
        last = max(self.last_used, self.engine.last_event_s if self.engine is not None else 0)
        return now - last

    def state(self) -> str:
        if self.loading is not None:
            return "loading"
        if self.ready:
            return "loaded"
        if self.engine is not None and self.engine.state is EngineState.DEAD:
            return "failed"
        return "unloaded"


class ModelPool:
    def __init__(self, cfg: ServeConfig, members: dict[str, ServeConfig], app_ctx: Any,
                 registry: CollectorRegistry, launch: list[str] | None = None) -> None:
        # a one-model launch with server.isolate=true is a pool of that model, which every
        # request runs on whatever its `model` says (as in-process)
        self.single = cfg.pool is None
        self.cfg = cfg.pool if cfg.pool is not None else PoolConfig(
            models={cfg.model.name: None}, max_resident=1)   # type: ignore[dict-item]
        self.app_ctx, self.registry = app_ctx, registry
        self.members = {i: Member(i, c, app_ctx) for i, c in members.items()}
        self.metrics = pool_metrics.PoolMetrics(registry)
        for i in self.members:
            self.metrics.resident.labels(i).set(0)
            self.metrics.loading.labels(i).set(0)
        self._idle_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room = asyncio.Lock()
        self.launch = list(launch or [])   # the launch's overrides: members compose over them
        self.scanned = ({i for i in members if i not in self.cfg.models}
                        if self.cfg.model_dir is not None else set())   # ids from model_dir
        self.default_id = self.cfg.default_id or next(iter(self.members))

    @property
    def ids(self) -> list[str]:
        return list(self.members)

    # -- routing -------------------------------------------------------------------------
    def member(self, model: Any) -> Member:
        """The member a request's `model` names (`<id>:<adapter>` names the id's adapter); the
        default member when it names none; a 404 listing the ids otherwise."""
        if model is None or model == "" or self.single:
            return self.members[self.default_id]
        name = model.partition(":")[0] if isinstance(model, str) else None
        found = self.members.get(name) if name is not None else None
        if found is None:
            shown = model if isinstance(model, str) else repr(model)
            raise NotFound(f"model {shown[:200]!r} is not served here; the models are: "
                           f"{', '.join(self.members)}", param="model", code="model_not_found")
        return found

    async def context(self, model: Any, *, pin: bool = False,
                      keep_alive: float | None = None) -> Member:
        """The request's member, loaded: waits while it (or, to make room, another) loads, at
        most pool.load_timeout_s. `pin`: a generation's; the member is not evicted until
        its `release()`. Its `keep_alive` (seconds; < 0: never) then replaces
        pool.idle_unload_s for this member until the next generation request."""
        m = self.member(model)
        m.last_used = time.monotonic()
        if pin:
            m.pins += 1
            m.keep_alive_s = keep_alive
        try:
            await self.loaded(m)
        except BaseException:
            if pin:
                m.release()
            raise
        return m

    async def loaded(self, m: Member) -> None:
        """Load `m` unless it is loaded; waits for a load under way."""
        if m.ready:
            return
        if m.loading is None:
            m.loading = asyncio.get_running_loop().create_task(self._load(m))
        await asyncio.shield(m.loading)
        m.last_used = time.monotonic()

    def models_body(self) -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": m.id, "object": "model", "created": now, "owned_by": "pipeserve",
             "loaded": m.ready, "state": m.state()} for m in self.members.values()]}

    # -- loading and unloading -----------------------------------------------------------
    async def _load(self, m: Member) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.cfg.load_timeout_s
        t0 = time.perf_counter()
        self.metrics.loading.labels(m.id).set(1)
        outcome = "failed"
        try:
            try:
                async with self._room:   # one load at a time picks what to evict
                    await self._make_room(m, time.monotonic() + timeout)
                    m.admitted = True
            except EngineUnavailable:
                outcome = "busy"   # traffic, not the model: it never started loading
                raise
            previous = m.engine.last_limits if m.engine is not None else None
            engine = ChildEngine(m.id, m.cfg, m.metrics, previous, self._exited)
            m.engine = engine
            log.info("model %s: loading (load %d; resident: %s)", m.id, m.num_loads + 1,
                     ", ".join(x.id for x in self.members.values() if x.ready) or "none")
            await loop.run_in_executor(None, engine.start)
            log.info("model %s: engine process %s started", m.id, engine.pid)
            left = timeout - (time.perf_counter() - t0)
            ok = await loop.run_in_executor(None, engine.wait_ready, max(left, 0.0))
            if not ok and engine.state is EngineState.LOADING:
                outcome = "timeout"
                await loop.run_in_executor(None, engine.kill)
                raise EngineUnavailable(
                    f"model {m.id} did not load within pool.load_timeout_s={timeout:g} s; "
                    "its engine process was stopped — retry, or raise pool.load_timeout_s",
                    code="model_load_timeout")
            if not ok:
                # the cause's text goes to the log only (it may name the server's files)
                err = engine.startup_error   # from the child: RuntimeError("<type>: <text>")
                cause = (str(err).partition(":")[0] if type(err) is RuntimeError
                         else type(err).__name__)
                log.error("model %s: load failed: %s", m.id, engine.startup_error)
                raise EngineUnavailable(f"model {m.id} failed to load ({cause}); the server log "
                                        "has the details", code="model_load_failed")
            m.weight_bytes = int(engine.facts.get("weight_bytes") or m.weight_bytes)
            await self._fit_memory(m)
            m.front = None if m.cfg.model.encoder else Front(m.cfg, engine, m.metrics)
            assert engine.limits is not None
            adapters = engine.limits.adapters   # the launch default's names the record
            m.record = base_record(m.cfg, m.config_hash, engine.limits.model.fingerprint,
                                   adapters.identity(None) if adapters is not None else None)
            outcome = "ok"
            m.num_loads += 1
            self.metrics.resident.labels(m.id).set(1)
            log.info("model %s: loaded in %.2f s (engine process %s; %s in the child)", m.id,
                     time.perf_counter() - t0, engine.pid,
                     f"{engine.facts.get('load_s', 0):.2f} s")
        finally:
            elapsed = time.perf_counter() - t0
            self.metrics.load_seconds.labels(m.id, outcome).observe(elapsed)
            self.metrics.loads.labels(m.id, outcome).inc()
            self.metrics.loading.labels(m.id).set(0)
            m.loading, m.admitted = None, False
            if outcome != "ok":
                log.error("model %s: load %s after %.2f s", m.id, outcome, elapsed)

    async def rescan(self) -> tuple[list[str], list[str]]:
        """pool.model_dir again: (ids added, ids removed). A member whose files went away
        stays while it is loaded or loading."""
        assert self.cfg.model_dir is not None
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, scan, self.cfg.model_dir)
        added = [i for i in found if i not in self.members]
        for model_id in added:   # Hydra's compose: in the executor, one at a time
            cfg = await loop.run_in_executor(None, compose_member, self.launch, model_id,
                                             found[model_id])
            self.members[model_id] = Member(model_id, cfg, self.app_ctx)
            self.metrics.resident.labels(model_id).set(0)
            self.metrics.loading.labels(model_id).set(0)
            self.scanned.add(model_id)
        removed = [i for i in sorted(self.scanned) if i not in found and i != self.default_id
                   and not self.members[i].resident and not self.members[i].pins]
        for model_id in removed:
            del self.members[model_id]
            self.scanned.discard(model_id)
        if added or removed:
            log.info("pool.model_dir rescanned: added %s; removed %s", ", ".join(added) or "none",
                     ", ".join(removed) or "none")
        return added, removed

    def _over_memory(self, m: Member, others: list[Member]) -> bool:
        budget = self.cfg.memory_gb
        return budget is not None and (m.weight_bytes + sum(x.weight_bytes for x in others)
                                       > budget * 1e9)

    async def _make_room(self, m: Member, deadline: float) -> None:
        """Evict least recently used idle members until `m` fits in pool.max_resident and in
        pool.memory_gb (with its weights as last loaded, or as its files weigh). While every
        resident member is busy or loading, wait for one to go idle (until `deadline`)."""
        while True:
            others = [x for x in self.members.values() if x is not m and x.resident]
            over = self._over_memory(m, others)
            if len(others) < self.cfg.max_resident and not over:
                return
            idle = [x for x in others if x.evictable]
            if idle:
                await self.unload(min(idle, key=lambda x: x.last_used),
                                  "memory" if over else "lru")
                continue
            if time.monotonic() >= deadline:
                limit = (f"pool.memory_gb={self.cfg.memory_gb:g}" if over
                         else f"pool.max_resident={self.cfg.max_resident}")
                raise EngineUnavailable(
                    f"model {m.id} is not loaded and for pool.load_timeout_s="
                    f"{self.cfg.load_timeout_s:g} s the resident model(s) "
                    f"({', '.join(x.id for x in others)}) stayed busy or loading ({limit}); "
                    "retry shortly", code="pool_busy")
            await asyncio.sleep(ROOM_POLL_S)

    async def _fit_memory(self, m: Member) -> None:
        """After `m` loaded (its weights now known): unload idle others it does not fit beside."""
        while True:
            others = [x for x in self.members.values() if x is not m and x.resident]
            idle = [x for x in others if x.evictable]
            if not self._over_memory(m, others) or not idle:
                return
            await self.unload(min(idle, key=lambda x: x.last_used), "memory")

    async def unload(self, m: Member, reason: str) -> None:
        engine = m.engine
        if engine is None or engine.state is not EngineState.READY:
            return
        t0 = time.perf_counter()
        engine.retire()   # from now on a request for it loads it again (a new process)
        self.metrics.resident.labels(m.id).set(0)
        self.metrics.unloads.labels(m.id, reason).inc()
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        log.info("model %s: unloaded (%s) in %.2f s; engine process %s exited", m.id, reason,
                 time.perf_counter() - t0, engine.pid)

    def _exited(self, engine: ChildEngine) -> None:
        """Reader thread: a child's pipe closed. One that was not asked to stop died; one
        model alone (server.isolate=true) is restarted at once, so /health, which fails
        while it is down, comes back without waiting for a request."""
        if engine.state is EngineState.DEAD and engine.limits is not None:
            self.metrics.resident.labels(engine.model_id).set(0)
            self.metrics.unloads.labels(engine.model_id, "exited").inc()
            if self.single and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._restart, engine.model_id)
                except RuntimeError:
                    pass   # the loop is closed: the server is stopping

    def _restart(self, model_id: str) -> None:
        """Event loop: load a member whose engine died, unless a request already started it."""
        m = self.members.get(model_id)
        if m is None or m.loading is not None or m.ready or m.draining:
            return
        log.info("model %s: restarting its engine process", model_id)
        m.loading = asyncio.get_running_loop().create_task(self._load(m))
        m.loading.add_done_callback(lambda t: t.cancelled() or t.exception())

    def single_state(self) -> EngineState:
        """One model alone: its engine's state as /health reports it (a model unloaded by
        keep_alive serves on demand: ready)."""
        m = self.members[self.default_id]
        if m.ready:
            return EngineState.READY
        if m.loading is not None:
            return EngineState.LOADING
        if m.engine is not None and m.engine.state is EngineState.DEAD:
            return EngineState.DEAD
        return EngineState.READY if m.num_loads else EngineState.LOADING

    # -- the server's lifecycle ----------------------------------------------------------
    def started(self, build: dict[str, str]) -> None:
        """After the listener is up: the build info (`model` names the ids), the idle sweeper,
        and the default model loads."""
        self.app_ctx.metrics.build.info({**build, "model": ",".join(self.members),
                                         "model_fingerprint": "", "device": "pool"})
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._idle_task = loop.create_task(self._sweep())   # idle_unload_s and keep_alive
        default = self.members[self.default_id]
        if default.loading is None and not default.ready:   # a first request may have begun it
            default.loading = loop.create_task(self._load(default))
            default.loading.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _sweep(self) -> None:
        """Unload members idle past their limit: the last request's keep_alive (seconds; 0:
        right after it; < 0: never), else pool.idle_unload_s (0: never)."""
        idle = self.cfg.idle_unload_s
        tick = min(1.0, idle / 4) if idle > 0 else 0.25
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for m in list(self.members.values()):
                limit = m.keep_alive_s if m.keep_alive_s is not None else (idle or -1.0)
                if limit >= 0 and m.evictable and m.idle_s(now) >= limit:
                    await self.unload(m, "idle" if m.keep_alive_s is None else "keep_alive")

    def live(self) -> list[ChildEngine]:
        return [m.engine for m in self.members.values() if m.ready and m.engine is not None]

    def stop(self) -> None:
        """Any thread, at shutdown: every engine process stops (after its SSD flush)."""
        if self._idle_task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._idle_task.cancel)
        for m in self.members.values():
            engine = m.engine
            if engine is None:
                continue
            if engine.state is EngineState.READY:
                self.metrics.unloads.labels(m.id, "shutdown").inc()
                engine.stop()
            elif engine.state is EngineState.LOADING:
                engine.kill()

    async def exposition(self) -> bytes:
        """The server's families, then per member its HTTP side and its engine's."""
        loop = asyncio.get_running_loop()
        texts = await asyncio.gather(*(loop.run_in_executor(None, e.metrics_text, 5.0)
                                       for e in self.live()))
        by_model = {e.model_id: t for e, t in zip(self.live(), texts) if t is not None}
        server_keep = (pool_metrics.SERVER_FAMILIES | pool_metrics.PROCESS_FAMILIES
                       | self.metrics.names)
        sources: list[tuple[str, str, Any, Any]] = [
            ("", generate_latest(self.registry).decode(), server_keep, ())]
        for m in self.members.values():
            sources.append((m.id, generate_latest(m.registry).decode(),
                            pool_metrics.MEMBER_FAMILIES, ()))
            if m.id in by_model:
                sources.append((m.id, by_model[m.id], None,
                                pool_metrics.MEMBER_FAMILIES | pool_metrics.SERVER_FAMILIES))
        return pool_metrics.merge(sources)


def _weight_files_bytes(cfg: ServeConfig) -> int:
    """What a model's weight files weigh when model.path is a directory (0: not known until it
    loads: a generated model, a GGUF file, a Hugging Face id)."""
    from pathlib import Path

    if cfg.model.path is None:
        return 0
    path = Path(cfg.model.path).expanduser()
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
