"""Who runs in the next engine step, with how many tokens; and what the results mean.
Engine thread only; imports no mlx (results arrive as host lists)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline.config import ServeConfig
from pipeline.events import Event, Finished, TokenDelta
from pipeline.memory import MemoryModel
from pipeline.request import FinishReason, Request, RequestStatus, TokenLogprob
from pipeline.stage import Batch


SHARED_PREFIX_MIN = 64   # prompt tokens two requests must share for one to wait for the other


@dataclass(slots=True)
class StepResult:
    """Host copies of one step's sampled outputs, one entry per sample row."""

    token_ids: list[list[int]]     # per sample row: one token, or accepted drafts + one
    logprobs: list[list[float]] | None = None
    top: list[list[list[tuple[int, float]]]] | None = None

    @classmethod
    def single(cls, token_ids: list[int], logprobs: list[float] | None,
               top: list[list[tuple[int, float]]] | None) -> StepResult:
        """One token per row (a plain decode step)."""
        return cls([[t] for t in token_ids],
                   [[lp] for lp in logprobs] if logprobs is not None else None,
                   [[t] for t in top] if top is not None else None)


class _Scheduler:
    """Shared membership and result handling. Subclasses decide `schedule()`.
    A request's prompt (all but its last token) is prefilled in chunks; after that each step
    feeds one token and samples one. Decode steps may be queued one ahead of the results
    (`num_scheduled_outputs`), so a result may arrive for a request that already finished."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.chunk = cfg.scheduler.prefill_chunk
        self.max_batch = cfg.scheduler.max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.memory: MemoryModel | None = None
        self.kv_budget: int | None = None   # bytes of KV all running rows may reserve
        self.kv_reserved = 0
        self.on_admit: Callable[[Request], None] | None = None   # the cache_lookup hook
        self.share_prefixes = False   # set when a prompt cache can hand prefixes over

    def set_memory(self, memory: MemoryModel, kv_budget: int | None) -> None:
        self.memory, self.kv_budget = memory, kv_budget

    # -- membership -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; returns it (status FINISHED) or None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self._finish(req, FinishReason.ABORT)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fail_all(self) -> list[Request]:
        reqs = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        for req in reqs:
            self._finish(req, FinishReason.ERROR)
        return reqs

    # -- stepping ---------------------------------------------------------------------
    def _admit(self) -> None:
        """FIFO: the head waits until a row slot and, under a KV budget, its projected KV
        (prompt + max_tokens) are free; later requests never overtake it. With a prompt
        cache, a request whose prompt starts like one still being prefilled waits for that
        prefill (then reuses its prefix) while others go ahead: N agents sharing a system
        prompt pay for one prefill."""
        deferred: list[Request] = []
        try:
            while self.waiting and len(self.running) < self.max_batch:
                req = self.waiting[0]
                if self.share_prefixes and self._donor_prefilling(req):
                    deferred.append(self.waiting.popleft())
                    continue
                if self.kv_budget is not None and self.memory is not None:
                    need = self.memory.kv_bytes(req.num_prompt_tokens + req.sampling.max_tokens)
                    if self.running and self.kv_reserved + need > self.kv_budget:
                        return
                    req.kv_reserved_bytes = need
                    self.kv_reserved += need
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if self.on_admit is not None:
                    self.on_admit(req)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _donor_prefilling(self, req: Request) -> bool:
        n = SHARED_PREFIX_MIN
        if req.num_prompt_tokens <= n:
            return False
        head = req.prompt_ids[:n]
        return any(r.in_prefill and r.num_prompt_tokens > n and r.prompt_ids[:n] == head
                   for r in self.running)

    def schedule(self) -> Batch | None:
        """Admit waiting requests, then give each running request its tokens for this step:
        prefill chunks first (FIFO, within the prefill budget), then one decode token each."""
        self._admit()
        budget = self.cfg.scheduler.prefill_budget or self.chunk
        rows: list[Request] = []
        counts: list[int] = []
        for req in self.running:
            if req.in_prefill:
                n = min(self.chunk, budget, req.num_prompt_tokens - 1 - req.num_computed_tokens)
                if n <= 0:
                    continue
                budget -= n
                req.num_computed_tokens += n
            elif req.num_scheduled_outputs < req.sampling.max_tokens:
                n = 1
                req.num_computed_tokens += 1
                req.num_scheduled_outputs += 1
            else:
                continue
            rows.append(req)
            counts.append(n)
        return Batch(requests=rows, num_new_tokens=counts) if rows else None

    def update(self, batch: Batch, result: StepResult) -> Iterable[tuple[Request, Event]]:
        """Apply a step's sampled tokens; yield (request, event) pairs to post."""
        for i, row in enumerate(batch.sample_rows):
            req = batch.requests[row]
            if req.status is not RequestStatus.RUNNING:
                continue  # finished while this step was in flight; its token is discarded
            tokens: list[int] = []
            lps: list[TokenLogprob] | None = [] if req.sampling.logprobs and \
                result.logprobs is not None else None
            reason = None
            for j, token in enumerate(result.token_ids[i]):
                if token in req.stop_token_ids:
                    reason = FinishReason.STOP
                    break
                tokens.append(token)
                if lps is not None:
                    top = result.top[i][j][: req.sampling.top_logprobs] if result.top else []
                    lps.append(TokenLogprob(token, result.logprobs[i][j], top))
                if len(req.output_ids) + len(tokens) >= req.sampling.max_tokens:
                    reason = FinishReason.LENGTH
                    break
            if tokens:
                req.output_ids.extend(tokens)
                yield req, TokenDelta(req.request_id, tokens, lps)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                yield req, self._finished(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished; the engine persists and then frees the row's KV (`release`)."""
        self.kv_reserved -= req.kv_reserved_bytes
        req.kv_reserved_bytes = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    @staticmethod
    def release(req: Request) -> None:
        req.cache = None
        req.prefill_group = None
        req.row_state = None
        req.next_input = None

    @staticmethod
    def _finished(req: Request) -> Finished:
        assert req.finish_reason is not None
        extras: dict[str, object] = {"batch_size_max": req.batch_size_max}
        if req.draft_state is not None or req.spec_proposed:
            extras["speculation"] = {"proposed": req.spec_proposed,
                                     "accepted": req.spec_accepted}
        return Finished(req.request_id, req.finish_reason, req.num_prompt_tokens,
                        len(req.output_ids), num_cached_tokens=req.num_cached_tokens,
                        extras=extras)


class SerialScheduler(_Scheduler):
    """FIFO, one request at a time, each decoding with its own cache exactly as mlx-lm does:
    arrival-independent numerics for golden tests."""

    def __init__(self, cfg: ServeConfig) -> None:
        super().__init__(cfg)
        self.max_batch = 1


class ContinuousScheduler(_Scheduler):
    """Requests join and leave between steps, up to `scheduler.max_batch` rows. A lone request
    runs at batch size 1; prefill of a newcomer shares steps with the others' decode, bounded by
    `scheduler.prefill_budget` prompt tokens per step."""
