"""The engine's per-step hook in a distributed launch: every rank runs the same engine loop, and
once per pass `next_plan` keeps them in lockstep — rank 0 takes its inbox's commands, schedules,
and broadcasts both (pipeserve/distributed/wire.py); every other rank applies the same commands
to its own scheduler, schedules, and checks it planned what rank 0 planned. Then each rank runs
the step on its shard, and every rank samples the same tokens from the same logits (the layers'
all_sums give every rank identical activations), so the next step's input stays on the device
as on one process, with no extra collective per token; a digest of each rank's scheduler state
rides on every sync and must match rank 0's. Engine thread."""
from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from pipeserve.distributed import wire
from pipeserve.distributed.shard import world
from pipeserve.core.events import Submit
from pipeserve.core.plan import StepPlan
from pipeserve.core.engine import EngineState
from pipeserve.core.limits import EngineLimits
from pipeserve.grammar.constraint import GrammarCompiler

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.core.engine import Engine
    from pipeserve.metrics import Metrics

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.5   # rank 0 keeps the ring open this long after sending STOP


class DistributedError(RuntimeError):
    """The group cannot go on: a rank left, or the ranks disagree. The message says which."""


class Group:
    def __init__(self, cfg: ServeConfig, metrics: Metrics) -> None:
        self.cfg = cfg.distributed
        self.metrics = metrics
        self.world = world()
        self.rank, self.size = self.world.rank(), self.world.size()
        self.seq = 0
        self._synced_s: float | None = None   # when the previous sync ended
        self._sync_s = 0.0
        self._grammars: Any = None   # other ranks: compiles constraints as admission does
        self._failing = False
        self._stop_sent = False   # rank 0: the group has been told to stop
        self._ran = False   # rank 0: the previous sync carried a plan (its slots time a step)
        self._watchdog: threading.Thread | None = None
        metrics.distributed_ranks.set(self.size)
        self._step = [metrics.distributed_step_seconds.labels(str(r)) for r in range(self.size)]
        self._syncs = [metrics.distributed_sync_seconds.labels(str(r)) for r in range(self.size)]

    # -- the hook -----------------------------------------------------------------------
    def next_plan(self, engine: Engine, idle: bool) -> StepPlan | None:
        """Rank 0: drain the inbox (blocking up to heartbeat_s when idle), schedule, broadcast.
        Other ranks: receive, apply, schedule, check. None: nothing to run (or stopping)."""
        step_s = time.perf_counter() - self._synced_s if self._synced_s is not None else 0.0
        if self._watchdog is None:
            self._arm(engine)
        try:
            if self.rank == 0:
                return self._lead(engine, idle, step_s)
            return self._follow(engine, step_s)
        except DistributedError as e:   # the ranks disagree: every rank saw the same header
            self.fatal(e)
        except RuntimeError as e:   # the backend: "[ring] connection to a peer was lost"
            self.fatal(DistributedError(f"rank {self.rank}: the group's sync failed ({e}): a "
                                        "rank is gone — its log says why; the group stops"), e)

    def fatal(self, err: BaseException, cause: BaseException | None = None) -> NoReturn:
        """The group cannot go on: raise out of the engine loop (the engine dies: /health 503,
        requests in flight fail). Rank 0 then stops its server after distributed.linger_s, so
        mlx.launch ends the job; other ranks exit with the reason in their log."""
        if not isinstance(err, DistributedError):
            log.error("rank %d: step failed", self.rank, exc_info=err)
            err = DistributedError(f"rank {self.rank}: a step failed ({err}): a rank is gone, "
                                   "or the ranks' collectives are out of step; the group stops")
            cause = cause or err.__cause__
        if self.rank == 0:
            self._stop_later()
        raise err from cause

    def _arm(self, engine: Engine) -> None:
        """Start the watchdog. Its clock starts at the group's first sync, not here: the ranks
        finish loading at different times (a shard on a slower disk), and one that waits in
        the first collective for another still loading is not stuck. A rank that dies while
        loading ends the job anyway (the backend, and mlx.launch, see it go)."""
        self._watchdog = threading.Thread(target=self._watch, args=(engine,), daemon=True,
                                          name=f"pipeserve-rank{self.rank}-watchdog")
        self._watchdog.start()

    def stalled(self, now: float) -> bool:
        """No sync for distributed.timeout_s since the previous one (never before the first)."""
        return self._synced_s is not None and now - self._synced_s >= self.cfg.timeout_s

    def _watch(self, engine: Engine) -> None:
        """A collective the backend never completes (a peer that hangs, or one whose loss the
        backend does not surface) must not hang the server: past distributed.timeout_s
        without a sync, rank 0 fails what is in flight, answers 503 and stops after
        linger_s; another rank exits."""
        while engine.state in (EngineState.LOADING, EngineState.READY):
            time.sleep(min(0.5, self.cfg.heartbeat_s))
            if not self.stalled(time.perf_counter()):
                continue
            err = DistributedError(
                f"rank {self.rank}: no sync with the other ranks for {self.cfg.timeout_s:.0f} s "
                "(distributed.timeout_s): a rank is gone or stuck — its log says why; the "
                "group stops")
            log.error("%s", err)
            if self.rank != 0:
                logging.shutdown()
                os._exit(1)
            engine.abandon(err)   # the engine thread is stuck in the backend
            self._stop_later()
            return

    def _stop_later(self) -> None:
        if not self._failing:
            self._failing = True
            threading.Timer(self.cfg.linger_s, os.kill, (os.getpid(), signal.SIGTERM)).start()

    # -- rank 0 ---------------------------------------------------------------------------
    def _lead(self, engine: Engine, idle: bool, step_s: float) -> StepPlan | None:
        digest = wire.state_digest(_requests(engine))
        commands = engine.take_commands(block=idle, timeout=self.cfg.heartbeat_s)
        for cmd in commands:
            # every rank must sample a seedless request with the same stream
            if isinstance(cmd, Submit) and cmd.request.sampling.seed is None:
                cmd.request.sampling.seed = random.getrandbits(63)
        stopping = engine.stopping
        plan = None if stopping else engine.scheduler.schedule()
        payload = b"" if stopping else wire.encode(commands, plan)
        kind = wire.Kind.STOP if stopping else wire.Kind.STEP
        header = self._exchange(digest, step_s, kind, payload)
        self._check(header, plan is not None)
        if stopping:
            self._stop_sent = True
            # the others read STOP from the collective that just ended here; closing the ring
            # at once could reset their half of it ("connection to a peer was lost")
            time.sleep(STOP_GRACE_S)
        return plan

    def leave(self, engine: Engine) -> None:
        """Engine thread, once its loop ended: rank 0 tells the others to stop if its last
        sync did not (the loop can end on `stopping` between two syncs), so they leave
        cleanly instead of finding the ring gone."""
        if self.rank != 0 or self._stop_sent or self._failing:
            return
        try:
            self._lead(engine, idle=False, step_s=0.0)
        except RuntimeError as e:   # a rank already gone: nobody left to tell
            log.warning("rank 0: could not tell the group to stop: %s", e)

    # -- the other ranks ------------------------------------------------------------------
    def _follow(self, engine: Engine, step_s: float) -> StepPlan | None:
        digest = wire.state_digest(_requests(engine))
        header, payload = self._receive(digest, step_s)
        self._check(header, bool(payload))
        if header.kind is wire.Kind.STOP:
            log.info("rank %d: rank 0 is stopping; leaving the group", self.rank)
            engine.stopping = True   # leave the step loop
            return None
        msg = wire.decode(payload)
        for cmd in msg.commands:
            if isinstance(cmd, Submit) and cmd.request.constraint is not None:
                cmd.request.grammar = self._compile(engine, cmd.request.constraint)
            engine.run_command(cmd)
        plan = engine.scheduler.schedule()
        rows, hits = wire.plan_rows(plan), wire.plan_hits(plan)
        if rows != msg.rows or hits != msg.hits:
            raise DistributedError(
                f"rank {self.rank} planned {rows} (prompt-cache hits {hits}) where rank 0 "
                f"planned {msg.rows} (hits {msg.hits}) at sync {header.seq}; the ranks' "
                "schedulers diverged, so the group stops")
        return plan

    def _compile(self, engine: Engine, constraint: Any) -> Any:
        if self._grammars is None:
            tok = engine.loaded.tokenizer
            vocab = EngineLimits.of(engine.cfg, engine.loaded).vocab_size
            self._grammars = GrammarCompiler(tok, vocab, tok.eos_token_ids)
        return self._grammars.matcher(constraint)

    # -- the collectives ------------------------------------------------------------------
    def _exchange(self, digest: int, step_s: float, kind: wire.Kind,
                  payload: bytes) -> wire.Header:
        t0 = time.perf_counter()
        self.seq += 1
        buf = wire.pack_header(self.size, 0, self._slot(digest, step_s), kind, payload, self.seq)
        header, _ = wire.unpack_header(self._all_sum(buf), self.size)
        if len(payload) > 4 * wire.INLINE_INTS:
            self._all_sum(wire.bytes_to_ints(payload))
        self._done(t0)
        return header

    def _receive(self, digest: int, step_s: float) -> tuple[wire.Header, bytes]:
        t0 = time.perf_counter()
        buf = wire.pack_header(self.size, self.rank, self._slot(digest, step_s))
        header, inline = wire.unpack_header(self._all_sum(buf), self.size)
        if inline is None:
            n = (header.payload_bytes + 3) // 4
            inline = wire.ints_to_bytes(self._all_sum(np.zeros(n, dtype=np.int32)),
                                        header.payload_bytes)
        self.seq = header.seq
        self._done(t0)
        return header, inline

    def _slot(self, digest: int, step_s: float) -> wire.Slot:
        return wire.Slot(int(step_s * 1e6), int(self._sync_s * 1e6), digest, wire.Status.OK)

    def _done(self, t0: float) -> None:
        self._synced_s = time.perf_counter()
        self._sync_s = self._synced_s - t0

    def _all_sum(self, buf: np.ndarray) -> np.ndarray:
        import mlx.core as mx
        out = mx.distributed.all_sum(mx.array(buf), group=self.world)
        mx.eval(out)
        return np.array(out)

    def _check(self, header: wire.Header, ran: bool) -> None:
        """Every rank sees the same summed header, so every rank reaches the same verdict."""
        mine = header.slots[0].digest
        for r, slot in enumerate(header.slots):
            if slot.status is not wire.Status.OK:
                raise DistributedError(f"rank {r} reported a failure at sync {header.seq}; "
                                       "its log says why")
            if slot.digest != mine:
                raise DistributedError(
                    f"rank {r}'s scheduler state (digest {slot.digest:#x}) differs from rank "
                    f"0's ({mine:#x}) at sync {header.seq}: the ranks sampled different tokens "
                    "or moved different counters, so the group stops")
        # rank 0 exports every rank's times: the slots hold the previous pass's, which timed a
        # step only when that sync carried a plan too (an idle sync waits out the heartbeat)
        timed, self._ran = self._ran and ran, ran
        if self.rank == 0 and timed:
            for r, slot in enumerate(header.slots):
                if slot.step_us:
                    self._step[r].observe(slot.step_us / 1e6)
                if slot.sync_us:
                    self._syncs[r].observe(slot.sync_us / 1e6)


def _requests(engine: Engine) -> list[Any]:
    s = engine.scheduler
    return list(s.running) + list(s.waiting)
