"""Who runs in the next engine step, with how many tokens (`schedule() -> StepPlan`), and what
a step's results mean (`update(plan, output)`): the only code that moves a request's token
counters. Engine thread only; imports no mlx (results arrive as host lists)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from pipeserve.config import ServeConfig
from pipeserve.core.events import Event, Finished, TokenDelta
from pipeserve.memory import MemoryModel
from pipeserve.core.plan import CacheHit, LookupResult, PlannedRow, StepOutput, StepPlan
from pipeserve.core import preempt
from pipeserve.request import FinishReason, Request, RequestStatus, TokenLogprob

SHARED_PREFIX_MIN = 64   # prompt tokens two requests must share for one to wait for the other


@dataclass(frozen=True, slots=True)
class Limits:
    """The step's shape, fitted to the device at load (scheduler.* unset → these defaults)."""

    max_batch: int
    max_num_batched_tokens: int
    prefill_chunk: int

    @classmethod
    def fit(cls, cfg: ServeConfig, on_gpu: bool) -> Limits:
        s = cfg.scheduler
        budget = (s.max_num_batched_tokens if s.max_num_batched_tokens is not None
                  else (16384 if on_gpu else 2048))
        if s.max_batch is not None:
            rows = s.max_batch
            budget = max(budget, rows)   # an unset budget never starves the chosen rows
        else:
            rows = min(256 if on_gpu else 8, budget)   # an explicit budget is kept
        return cls(rows, budget, min(s.prefill_chunk, budget))


class Scheduler:
    """FIFO admission into at most `max_batch` running rows; each step, every decoding row
    gets its next token (1 + its drafts' room, so decode is never starved), and prompt chunks
    of as many prefilling rows as the rest of the token budget allows share the step.
    `scheduler=serial` is this with max_batch 1 (a lone row decodes with plain caches, the
    arithmetic of mlx-lm). A decode step may be scheduled before the previous one's result
    is read (pipelining): `_ahead` holds the tokens planned but not yet applied."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.limits = Limits.fit(cfg, on_gpu=False)
        self.num_drafts = cfg.draft.num_draft_tokens if cfg.draft.proposes else 0
        # a grammar row may also append the tokens its grammar forces (draft.fast_forward)
        self.num_forced = cfg.draft.fast_forward if cfg.draft.enabled else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.memory: MemoryModel | None = None
        self.kv_budget: int | None = None   # bytes of KV all running rows may reserve
        self.kv_reserved = 0
        self.lookup: Callable[[Request], LookupResult] | None = None   # cache_lookup stage
        # persist's: whether a row's prompt copy still waits (a donor until it is made)
        self.copying: Callable[[str], bool] | None = None
        self.shared_min = SHARED_PREFIX_MIN   # head a request must share to wait for a donor
        self._ahead: dict[str, int] = {}     # request id → tokens planned, not yet applied
        self._outputs_ahead: dict[str, int] = {}   # request id → decode steps in flight
        self._held_prompts = False   # the last plan left prompt chunks for first tokens
        self._hits: list[tuple[str, CacheHit]] = []
        # within one admission pass: rows a waiting request may wait for, by their head
        self._donors: dict[tuple[int, ...], list[Request]] | None = None
        self._lockstep = cfg.distributed.name != "none"
        # the priorities whose running rows a more urgent request may take (core/preempt.py);
        # a distributed group's followers hold KV this rank does not evict: none there
        adm = cfg.admission
        self.preemptible = frozenset() if self._lockstep else preempt.preemptible_priorities(
            adm.priority_classes, adm.preemptible)
        # the engine's: persist a preempted row's KV to the prompt cache, then free it
        self.evict: Callable[[Request], None] | None = None
        self.preempted: list[Request] = []   # rows preempted since the engine last read it
        # the engine's: MLX's active memory now, and the most admission lets it reach (None:
        # no memory gate); requests the gate has held, and how many were held since last read
        self.active_memory: Callable[[], int] | None = None
        self.memory_ceiling: int | None = None
        self.reclaim: Callable[[], bool] | None = None   # the prompt cache drops its oldest entry
        self._held: set[str] = set()
        self.memory_held = 0

    @property
    def max_batch(self) -> int:
        return self.limits.max_batch

    def configure(self, limits: Limits, memory: MemoryModel, kv_budget: int | None,
                  lookup: Callable[[Request], LookupResult] | None = None,
                  evict: Callable[[Request], None] | None = None,
                  copying: Callable[[str], bool] | None = None, min_reuse: int = 0,
                  active_memory: Callable[[], int] | None = None,
                  memory_ceiling: int | None = None,
                  reclaim: Callable[[], bool] | None = None) -> None:
        """At load, once the device and the stages are known: the step's shape, the memory
        model, the cache_lookup stage when a prompt cache can hand prefixes over, and the
        step's `evict` (no preemption without it) and persist's `copying` (a shared prefix is
        waited for until its copy is in the prompt cache; never for a head shorter than the
        lookup's `min_reuse`, which would not be reused). With `memory_ceiling`, a request
        joins only while `active_memory()` plus the KV of what is admitted stays under it;
        `reclaim` (the prompt cache's oldest entry out) makes room first: live rows come
        before cached prefixes."""
        self.limits, self.memory, self.kv_budget = limits, memory, kv_budget
        self.active_memory, self.memory_ceiling = active_memory, memory_ceiling
        self.reclaim = reclaim
        self.lookup, self.evict, self.copying = lookup, evict, copying
        self.shared_min = max(SHARED_PREFIX_MIN, min_reuse)

    # -- membership -------------------------------------------------------------------
    def add(self, request: Request, first: bool = False) -> None:
        """Into the queue in priority order (lower first; FIFO within a priority, or ahead of
        its priority when `first`: a preempted row)."""
        w = self.waiting
        if not first and (not w or request.priority >= w[-1].priority):
            w.append(request)
            return
        for i, other in enumerate(w):
            if other.priority > request.priority or (first and
                                                     other.priority == request.priority):
                w.insert(i, request)
                return
        w.append(request)

    def _promote_starved(self) -> None:
        """A request that has waited scheduler.max_wait_s goes ahead of every priority
        (bounded starvation); only a queue of mixed priorities needs the scan."""
        w, limit = self.waiting, self.cfg.scheduler.max_wait_s
        if limit is None or len(w) < 2 or w[-1].priority <= w[0].priority or self._lockstep:
            return   # (ranks of a distributed group schedule alike: no clock-based decisions)
        now = time.perf_counter()
        starved = sorted((r for r in w if 0 <= r.priority <= 9 and now - r.arrival_s > limit),
                         key=lambda r: r.arrival_s)
        for req in starved:   # oldest first, behind any aged before
            w.remove(req)
            req.priority = -1   # aged: nothing overtakes it now
            self.add(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Remove a request wherever it is; returns it (status FINISHED) or None if unknown."""
        self._held.discard(request_id)
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, reason)
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def outputs_ahead(self, request_id: str) -> int:
        """Decode steps of this request planned but not yet applied."""
        return self._outputs_ahead.get(request_id, 0)

    def tokens_ahead(self, request_id: str) -> int:
        """Tokens of this request planned (their KV computed or queued) but not applied."""
        return self._ahead.get(request_id, 0)

    def release(self, request_id: str) -> None:
        """The request is gone (persisted and freed): forget its in-flight ledger."""
        self._ahead.pop(request_id, None)
        self._outputs_ahead.pop(request_id, None)

    def fail_all(self) -> list[Request]:
        reqs = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        for req in reqs:
            self._finish(req, FinishReason.ERROR)
        return reqs

    # -- planning ---------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Admit waiting requests, then plan: one token (+ room for drafts) per decoding row
        first, then prompt chunks FIFO while the token budget lasts."""
        self._admit()
        lim = self.limits
        budget = lim.max_num_batched_tokens
        rows: list[PlannedRow] = []
        prefilling: list[tuple[Request, int]] = []
        for req in self.running:
            pos = req.num_computed_tokens + self._ahead.get(req.request_id, 0)
            if pos < req.num_prompt_tokens - 1:
                prefilling.append((req, pos))
                continue
            outputs = len(req.output_ids) + self._outputs_ahead.get(req.request_id, 0)
            if outputs >= req.sampling.max_tokens:
                continue
            room = self.num_drafts if req.grammar is None else max(self.num_drafts,
                                                                   self.num_forced)
            room = min(room, req.sampling.max_tokens - outputs - 1)
            rows.append(PlannedRow(req, pos, 1, max_drafts=max(0, room)))
        budget -= len(rows)
        rows = self._draft_room(rows, budget)
        budget -= sum(r.max_drafts for r in rows)
        first = sum(1 for r in rows if not r.request.output_ids
                    and not self._outputs_ahead.get(r.request_id))
        if len(prefilling) > 1:   # the prompt budget goes to the most urgent first (stable)
            prefilling.sort(key=lambda p: p[0].priority)
        for req, pos in prefilling:
            # chunks end on multiples of prefill_chunk (after a cache hit too): the attention
            # shapes of a prompt's chunks recur across prompts, so a GPU builds each kernel once
            n = min(lim.prefill_chunk - pos % lim.prefill_chunk, budget,
                    req.num_prompt_tokens - 1 - pos)
            for at in req.checkpoints_at:   # a chunk ends where persist keeps the state
                if at > pos:
                    n = min(n, at - pos)
                    break
            if req.media is not None:   # never inside an image attended both ways
                n = req.media.whole_spans(pos, n)
            if n <= 0:
                break
            rows.append(PlannedRow(req, pos, n))
            budget -= n
        held, self._held_prompts = self._held_prompts, False
        if not held and 0 < sum(1 for r in rows if not r.samples) < first:
            # more rows sample their first token than prompts would run beside them: a prompt
            # chunk is evaluated before the step's decode, so those first tokens would wait
            # for it (round 10: 29 rows held 75 ms by 3 late arrivals' prefill). The chunks go
            # in the next step, once these tokens are out; never two steps running
            rows = [r for r in rows if r.samples]
            self._held_prompts = True
        hits, self._hits = tuple(self._hits), []
        if not rows:
            return StepPlan((), hits) if hits else None
        for r in rows:
            self._ahead[r.request_id] = self._ahead.get(r.request_id, 0) + r.num_tokens
            if r.samples:
                rid = r.request_id
                self._outputs_ahead[rid] = self._outputs_ahead.get(rid, 0) + 1
            r.request.batch_size_max = max(r.request.batch_size_max, len(rows))
        return StepPlan(tuple(rows), hits)

    def _admit(self) -> None:
        """FIFO: the head waits until a row slot and, under a KV budget, its projected KV
        (prompt + max_tokens) are free; later requests never overtake it. With a prompt
        cache, a request whose prompt starts like one still being prefilled waits for that
        prefill (then reuses its prefix) while others go ahead: N agents sharing a system
        prompt pay for one prefill. With every row taken, or the KV budget spent, a less
        urgent preemptible row gives its row and its KV to the head (core/preempt.py)."""
        deferred: list[Request] = []
        self._donors = None   # built at the first waiting request this pass asks about
        self._promote_starved()
        room: int | None = None   # memory the gate still lets this pass admit (read once)
        try:
            while self.waiting:
                req = self.waiting[0]
                if self.lookup is not None and self._donor_prefilling(req):
                    deferred.append(self.waiting.popleft())
                    continue
                if len(self.running) >= self.limits.max_batch and not self._preempt_for(req):
                    return
                if self.memory_ceiling is not None and self.running:
                    room = self._memory_room() if room is None else room
                    need = self._memory_need(req.num_prompt_tokens)
                    while need > room and self.reclaim is not None:
                        before = self.active_memory()
                        if not self.reclaim():
                            break
                        freed = before - self.active_memory()   # what the entry held
                        room += freed
                        if freed <= 0:   # still held elsewhere (a row's view, the SSD writer)
                            break
                    if need > room:
                        if req.request_id not in self._held:
                            self._held.add(req.request_id)
                            self.memory_held += 1
                        return
                    room -= need
                if self.kv_budget is not None and self.memory is not None:
                    need = self.memory.kv_bytes(req.num_prompt_tokens + req.sampling.max_tokens)
                    while self.running and self.kv_reserved + need > self.kv_budget:
                        if not self._preempt_for(req):   # what a less urgent row holds
                            return
                    req.kv_reserved_bytes = need
                    self.kv_reserved += need
                self.waiting.popleft()
                if req.queue_wait_s is None:   # a readmission keeps its first wait
                    req.queue_wait_s = time.perf_counter() - req.arrival_s
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._held.discard(req.request_id)
                self._apply_hit(req)
                if self._donors is not None:   # a donor to those behind it from now on
                    self._add_donor(req)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _memory_need(self, tokens: int) -> int:
        """What `tokens` more of one row's prompt will add to MLX's active memory: its KV, and
        the copy of it its join to the batch makes."""
        return 2 * self.memory.kv_bytes(tokens) if self.memory is not None else 0

    def _memory_room(self) -> int:
        """Memory under the ceiling, less what rows still prefilling will take."""
        assert self.memory_ceiling is not None and self.active_memory is not None
        coming = sum(self._memory_need(r.num_prompt_tokens - r.num_computed_tokens)
                     for r in self.running if self._prefilling(r))
        return self.memory_ceiling - self.active_memory() - coming

    def _preempt_for(self, req: Request) -> bool:
        """Every row, or the KV budget, is taken: free a row and its KV for `req` if a less
        urgent, preemptible row runs."""
        if self.evict is None or not self.preemptible:
            return False
        out = preempt.victim(self.running, req.priority, self.preemptible)
        if out is None:
            return False
        self.evict(out)   # its KV, with the in-flight tokens the ledger still counts
        self.requeue(out)
        self.preempted.append(out)
        return True

    def requeue(self, req: Request) -> None:
        """A running row (its KV already freed) gives its row up and waits again, first among
        its priority, its output folded into its prompt (a preemption; a step that ran out of
        device memory): its readmission computes it again, or finds it in the prompt cache."""
        self.running.remove(req)
        self.release(req.request_id)
        self.kv_reserved -= req.kv_reserved_bytes
        req.kv_reserved_bytes = 0
        preempt.fold(req)
        self.add(req, first=True)

    def _apply_hit(self, req: Request) -> None:
        """The cache_lookup stage's answer, applied to the row: the positions persist still
        keeps, why tokens are recomputed, and the hit's tokens (and a resume's output)."""
        if self.lookup is None or req.num_computed_tokens:
            return
        found = self.lookup(req)
        req.checkpoints_at, req.cache_miss = found.checkpoints_at, found.cache_miss
        hit = found.hit
        if hit is None:
            return
        self._hits.append((req.request_id, hit))
        req.num_computed_tokens = hit.num_tokens
        if req.preemptions:   # a readmission: the client's prompt was cached as it first was
            return
        req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens - 1)
        if hit.output_ids:   # a checkpoint resume: its output is replayed, the last fed next
            req.output_ids = list(hit.output_ids)
            req.replay_ids = list(hit.output_ids)
            req.checkpointed_tokens = len(hit.output_ids)

    def _donor_prefilling(self, req: Request) -> bool:
        """Whether `req` should wait for a running row that is still prefilling (or whose
        prompt copy is still to be made) and shares its first shared_min tokens — unless the
        donor took that part from the cache itself: then `req` takes it from the cache too, and
        waits only if it also shares shared_min tokens past the donor's hit (128 arrivals on a
        cached system prompt are admitted together, not one a step)."""
        n = self.shared_min
        if req.num_prompt_tokens <= n:
            return False
        if self._donors is None:
            self._donors = {}
            for r in self.running:
                self._add_donor(r)
        ids = req.key_ids
        for r in self._donors.get(tuple(ids[:n]), ()):
            if r.status is not RequestStatus.RUNNING:   # preempted since it was indexed
                continue
            m = r.num_cached_tokens   # the donor's own hit: no gain in waiting for it
            if m and ids[m:m + n] != r.key_ids[m:m + n]:
                continue
            return True
        return False

    def _add_donor(self, r: Request) -> None:
        """Index a running row by its first shared_min tokens if a waiting request may wait
        for it (one dict probe an arrival, not a pass over every running row: 128 arrivals
        were 8,128 comparisons)."""
        n, copying = self.shared_min, self.copying
        if r.num_prompt_tokens <= n or not (
                self._prefilling(r) or (copying is not None and copying(r.request_id))):
            return
        self._donors.setdefault(tuple(r.key_ids[:n]), []).append(r)

    def _prefilling(self, req: Request) -> bool:
        return req.num_computed_tokens + self._ahead.get(req.request_id, 0) \
            < req.num_prompt_tokens - 1

    # -- results ----------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> Iterable[tuple[Request, Event]]:
        """Apply a step: move each row's counters by what it computed (a verifying row keeps
        its input and its accepted drafts), append the tokens it emitted and finish rows that
        hit a stop token or max_tokens. Yields (request, event) pairs to post."""
        for row in plan.rows:
            req, rid = row.request, row.request_id
            self._settle_ahead(rid, row)
            if req.status is not RequestStatus.RUNNING or rid in output.failed:
                continue   # finished while this step was in flight: its result is discarded
            out = output.rows.get(rid)
            if not row.samples:
                req.num_computed_tokens += row.num_tokens
                continue
            if out is None:
                continue
            req.num_computed_tokens += 1 + out.num_accepted
            req.num_forwarded += out.num_forced
            if out.num_drafts:
                req.spec_proposed += out.num_drafts
                req.spec_accepted += out.num_accepted - out.num_forced
            yield from self._emit(req, out)

    def _settle_ahead(self, rid: str, row: PlannedRow) -> None:
        left = self._ahead.get(rid, 0) - row.num_tokens
        if left > 0:
            self._ahead[rid] = left
        else:
            self._ahead.pop(rid, None)
        if row.samples:
            n = self._outputs_ahead.get(rid, 0) - 1
            if n > 0:
                self._outputs_ahead[rid] = n
            else:
                self._outputs_ahead.pop(rid, None)

    def _emit(self, req: Request, out) -> Iterable[tuple[Request, Event]]:
        tokens: list[int] = []
        lps: list[TokenLogprob] | None = [] if req.sampling.logprobs and \
            out.logprobs is not None else None
        reason = None
        for j, token in enumerate(out.token_ids):
            if token in req.stop_token_ids:
                reason = FinishReason.STOP
                break
            tokens.append(token)
            if lps is not None:
                top = out.top[j][: req.sampling.top_logprobs] if out.top else []
                lps.append(TokenLogprob(token, out.logprobs[j], top))
            if len(req.output_ids) + len(tokens) >= req.sampling.max_tokens:
                reason = FinishReason.LENGTH
                break
        if tokens:
            req.output_ids.extend(tokens)
            yield req, TokenDelta(req.request_id, tokens, lps, req.batch_size_max)
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)
            yield req, finished_event(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished; the engine persists and then frees the row's KV."""
        self.kv_reserved -= req.kv_reserved_bytes
        req.kv_reserved_bytes = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _draft_room(self, rows: list[PlannedRow], budget: int) -> list[PlannedRow]:
        """Room for drafts counts against the budget: none past draft.disable_by_batch_size
        decoding rows; shared evenly when the budget cannot hold every row's full draft."""
        off = self.cfg.draft.disable_by_batch_size
        if not rows or not (self.num_drafts or self.num_forced):
            return rows
        if off is not None and len(rows) > off:
            each = 0
        else:
            each = max(0, budget) // len(rows)
        if all(r.max_drafts <= each for r in rows):
            return rows
        return [replace(r, max_drafts=min(r.max_drafts, each)) for r in rows]


def finished_event(req: Request) -> Finished:
    assert req.finish_reason is not None
    extras: dict[str, object] = {"batch_size_max": req.batch_size_max}
    if req.spec_proposed or req.num_forwarded:
        extras["speculation"] = {"proposed": req.spec_proposed, "accepted": req.spec_accepted,
                                 "forwarded": req.num_forwarded}
    if req.cache_miss is not None:
        extras["cache_miss"] = req.cache_miss
    if req.queue_wait_s is not None:
        extras["queue_wait_s"] = req.queue_wait_s
    if req.preemptions:
        extras["preemptions"] = req.preemptions
    # a preempted row's prompt holds its earlier output (core/preempt.py): counted as output
    return Finished(req.request_id, req.finish_reason, req.num_prompt_tokens - req.num_folded,
                    len(req.output_ids) + req.num_folded, num_cached_tokens=req.num_cached_tokens,
                    extras=extras)
