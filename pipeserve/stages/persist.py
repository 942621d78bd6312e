"""Persist: put reusable KV prefixes into the prompt cache — each prompt once its prefill is
done (and at the positions tokenize marked: a chat history's end, cache_control breakpoints),
each finished request's prompt + output before its KV is freed, and (cache.checkpoint_every)
a checkpoint of each running row that emitted N more tokens.

A prompt's copy costs the host a few operations per layer (~2.4 ms a row on an 8B model on
the H200: 0.3 s for a burst of 128), so on a model whose KV can be cut back to any prefix it
waits in `pending` and `drain` makes it between steps, a few rows a pass (the batched ones
with one gather a layer), once the row's first token is out, while the device runs the next
step: the first tokens never wait for it. The copy then cuts the row's KV back
to the prompt position, so the entry holds what an immediate copy would have. It asks the row store for a
row's caches; it never looks for them. The scheduler's in-flight ledger and a checkpoint's
sampler key come in with its deps (`deps.ledger`, `deps.samplers`), never from another
stage's state. Engine thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pipeserve.config import ServeConfig
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import StepPlan
from pipeserve.prompt_cache.protocol import PREFIX_LAYOUTS, lend, rewinds
from pipeserve.request import FinishReason, Request
from pipeserve.core.stage import StageDeps
from pipeserve.stages.cache_lookup import min_reuse


class Persist:
    name: ClassVar[str] = "persist"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.cache = deps.prompt_cache
        self.checkpoints = self.cache.checkpoints if self.cache is not None else None
        self.ledger = deps.ledger       # tokens of a row planned but not applied (KV exists)
        self.samplers = deps.samplers   # the key a checkpoint resumes its sampler with
        # prompts whose copy waits for `drain`: row id → (request, prompt positions), oldest
        # first; only where any prefix of the KV is valid (attention-only models) and the
        # layout's row caches can be cut back by their offset
        self.pending: dict[str, tuple[Request, list[int]]] = {}
        # an entry shorter than the least prefix a lookup takes (cache.min_reuse_tokens: 256
        # on a GPU) could never serve a hit: such a prompt or finished row is not stored
        self.min_tokens = min_reuse(cfg)
        model = deps.loaded.model
        self.defer = (self.cache is not None and model is not None and rewinds(model)
                      and all(type(c) in PREFIX_LAYOUTS for c in deps.layout.make_cache(model)))

    def _tokens_ahead(self, rid: str) -> int:
        return self.ledger.tokens_ahead(rid) if self.ledger is not None else 0

    def prompts(self, plan: StepPlan, kv: RowStore) -> None:
        """Right after the forward: the prompts whose prefill finished in it (the prefix every
        request with the same system prompt or conversation shares)."""
        if self.cache is None:
            return
        for row in plan.prefill:
            req = row.request
            done = row.start + row.num_tokens
            if (done == req.num_prompt_tokens - 1 or done in req.checkpoints_at) \
                    and req.num_cached_tokens < done and done >= self.min_tokens:
                if self.defer:
                    self.pending.setdefault(row.request_id, (req, []))[1].append(done)
                    continue
                caches = kv.caches_of(row.request_id)
                if caches is not None:
                    self.cache.put(req.key_ids[:done], caches, req.adapter)

    def waiting(self, rid: str) -> bool:
        """Whether row `rid`'s prompt copy still waits for `drain`."""
        return rid in self.pending

    def drain(self, kv: RowStore, rows: int) -> None:
        """Between steps: the copies of up to `rows` waiting prompts whose rows have their
        first token out (a count, not a time, so every rank of a distributed group keeps the
        same entries). A copy made before it would sit between the step that sampled the
        first token and the loop reading it: a copy's host work (or an allocation that waits
        for the device) would delay that token."""
        copies: list[tuple[list[int], list[Any], str | None]] = []
        # (row, position) pairs, a row's positions in order; each round copies the batched
        # rows together (`copies_of`: one padding read and one gather a layer for the pass's
        # rows, where one `copy_of` a row read the padding and copied every layer per row)
        rounds: list[dict[str, tuple[Request, int]]] = []
        for rid in [r for r, (req, _) in self.pending.items() if req.output_ids][:rows]:
            req, positions = self.pending.pop(rid)
            if rid not in kv:   # freed meanwhile (failed, preempted, finished)
                continue
            kept = [done for done in positions
                    if (size := kv.entry_bytes(rid, done)) is None or self.cache.kept([size])]
            for k, done in enumerate(kept):   # one larger than the tier: a copy it would drop
                if k == len(rounds):
                    rounds.append({})
                rounds[k][rid] = (req, done)
        own: dict[str, list[Any]] = {}   # caches_of, once a row
        for wanted in rounds:
            fresh = kv.copies_of({rid: done for rid, (_, done) in wanted.items()})
            for rid, (req, done) in wanted.items():
                if rid in fresh:   # a batched row: the prefix alone, copied once
                    copies.append((req.key_ids[:done], fresh[rid], req.adapter))
                    continue
                if rid not in own:
                    own[rid] = kv.caches_of(rid)
                cut = [lend(c) for c in own[rid]]   # new objects: the row's own are untouched
                if any(getattr(c, "offset", None) != done for c in cut):
                    if not all(type(c) in PREFIX_LAYOUTS and c.offset > done for c in cut):
                        continue   # a layout that cannot be cut back: no entry, no harm
                    for c in cut:
                        c.trim(c.offset - done)
                self.cache.put(req.key_ids[:done], cut, req.adapter)
        if copies:   # one device call for the pass's copies: each call gives the GIL up, and
            # a busy event loop beside the engine thread may keep it a switch interval
            with self.cache.batch():
                for tokens, caches, adapter in copies:
                    self.cache.put(tokens, caches, adapter, handed=True)

    def __call__(self, finished: Sequence[Request], running: Sequence[Request],
                 kv: RowStore) -> None:
        """After a step is applied: finished rows (before their KV is freed), checkpoints."""
        if self.cache is None:
            return
        # rows finishing together: a tier that evicts the oldest first would drop the first
        # of their entries to make room for the last, so those are never copied
        sizes = {r.request_id: kv.entry_bytes(r.request_id, self._entry_tokens(r))
                 for r in finished if self._entry_tokens(r)}
        # one larger than the whole tier is never kept, wherever it comes
        keep = {r.request_id: (n := sizes.get(r.request_id)) is None or self.cache.kept([n]) > 0
                for r in finished}
        known = [n for rid, n in sizes.items() if n is not None and keep[rid]]
        skip = len(known) - self.cache.kept(known)
        for req in finished:
            if skip > 0 and keep[req.request_id] and sizes.get(req.request_id) is not None:
                keep[req.request_id], skip = False, skip - 1
        # the batched rows' copies: one padding read for each batch they leave; the puts'
        # copies go to the device in one call, after the evictions the puts make
        fresh = kv.copies_of({r.request_id: n for r in finished
                              if keep[r.request_id] and (n := self._entry_tokens(r))})
        with self.cache.batch():
            for req in finished:   # its prompt + output entry covers a prompt still waiting
                self.pending.pop(req.request_id, None)
                self._finished(req, kv, keep=keep[req.request_id],
                               fresh=fresh.get(req.request_id))
        if self.checkpoints is not None:
            for req in running:
                self._checkpoint(req, kv)

    def keep(self, req: Request, kv: RowStore) -> None:
        """A preempted row, before its KV is freed: what it computed (prompt and output so
        far) goes into the prompt cache, so its readmission is a hit."""
        if self.cache is not None:
            self.pending.pop(req.request_id, None)
            self._finished(req, kv)

    def _entry_tokens(self, req: Request) -> int:
        """How many tokens a finished row's entry would hold (0: it makes none)."""
        if req.finish_reason is FinishReason.ERROR or req.num_computed_tokens < 1:
            return 0
        fed = req.num_computed_tokens + self._tokens_ahead(req.request_id)   # KV held
        n = min(fed, len(req.key_ids) + len(req.output_ids))
        return n if n >= self.min_tokens else 0

    def _finished(self, req: Request, kv: RowStore, keep: bool = True,
                  fresh: list[Any] | None = None) -> None:
        """Before its KV is freed: keep what the finished (or cancelled) row computed (unless
        `keep` is False: the cache would not hold it); a completed row's checkpoint is no
        longer needed (a client cancel keeps it). `fresh`: the batched row's copy, made
        already (`RowStore.copies_of`)."""
        if self.checkpoints is not None and req.checkpointed_tokens and req.finish_reason in (
                FinishReason.STOP, FinishReason.LENGTH):
            self.checkpoints.drop(req)
        if not keep or not self._entry_tokens(req):
            return
        known = req.key_ids + req.output_ids
        fed = req.num_computed_tokens + self._tokens_ahead(req.request_id)   # KV held
        if fresh is None:
            fresh = kv.copy_of(req.request_id, min(fed, len(known)))   # a batched row's, once
        if fresh is not None:
            self.cache.put(known[:min(fed, len(known))], fresh, req.adapter, handed=True)
            return
        caches = kv.caches_of(req.request_id)
        if caches is None:
            return
        if fed > len(known):            # e.g. the stop token was fed one step ahead
            if not all(c.is_trimmable() for c in caches):
                return
            for c in caches:
                c.trim(fed - len(known))
            fed = len(known)
        # freed right after: buffers only this row holds become the entry, not a copy of it
        self.cache.put(known[:fed], caches, req.adapter, handed=kv.sole(req.request_id))

    def _checkpoint(self, req: Request, kv: RowStore) -> None:
        """Host copies here, disk writes on the SSD writer thread."""
        if req.num_computed_tokens < req.num_prompt_tokens or not self.checkpoints.due(req):
            return
        caches = kv.caches_of(req.request_id)
        if caches is None:
            return
        # the key the next unseen token will be sampled with (a sampled step may be ahead)
        ahead = self.ledger is not None and self.ledger.outputs_ahead(req.request_id) > 0
        key = (self.samplers.checkpoint_key(req.request_id, ahead)
               if self.samplers is not None else None)
        self.checkpoints.save(req, [lend(c) for c in caches], key,
                              req.num_computed_tokens + self._tokens_ahead(req.request_id))
