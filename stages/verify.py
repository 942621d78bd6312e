"""Verify: after a forward that fed each decode row its input token plus its drafts, accept the
longest prefix of drafts the target agrees with (greedy: equal to its argmax; sampling: the
speculative-sampling rule, so the output is distributed exactly as the target's), emit those
plus the target's own next token, and roll back the rest: KV trim for attention layers (in the
shared batch a row's surplus becomes left padding), snapshot + replay for recurrent layers.
Engine thread; reads the acceptance back to the host (a verify step is never pipelined)."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from pipeline.config import ServeConfig
from pipeline.draft.accept import accept_greedy, accept_sampling, emitted_lists
from pipeline.errors import ConfigError
from pipeline.kv.batch import drop_shared_padding, trim_rows
from pipeline.request import Request
from pipeline.stage import Batch, EngineContext


class Verify:
    name: ClassVar[str] = "verify"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.shared = cfg.scheduler.shared_decode
        probe = ctx.layout.make_cache(ctx.model)
        for c in probe:
            if isinstance(c, RotatingKVCache) or not (c.is_trimmable() or
                                                      isinstance(c, ArraysCache)):
                raise ConfigError(
                    f"draft={cfg.draft.name} needs KV that can be rolled back; layer type "
                    f"{type(c).__name__} (kv={cfg.kv.name}) cannot be (sliding-window layers "
                    "are not supported with speculative decoding)")
        m = ctx.metrics
        self._proposed = m.spec_proposed.labels(cfg.draft.name)
        self._accepted = m.spec_accepted.labels(cfg.draft.name)
        self._verifies = m.spec_verifies.labels(cfg.draft.name)
        self._emitted = m.spec_emitted.labels(cfg.draft.name)

    def __call__(self, batch: Batch) -> None:
        if not batch.sample_rows:
            return
        proposer = self.ctx.proposer
        if batch.width == 1:   # a plain decode step (no row drafted)
            if batch.hidden is not None:
                for i, r in enumerate(batch.sample_rows):
                    req = batch.requests[r]
                    self._row(batch, i, proposer.capture, req, req.num_computed_tokens - 1,
                              batch.hidden[i:i + 1])
            return
        batch.sync = True
        reqs = [batch.requests[r] for r in batch.sample_rows]
        drafts = [(batch.drafts or {}).get(r, []) for r in batch.sample_rows]
        num_accepted, emitted = self._accept(batch, reqs, drafts)
        self._report_logprobs(batch, reqs, emitted)
        self._rollback(batch, reqs, [len(e) - 1 for e in emitted])
        for i, (req, d, a, e) in enumerate(zip(reqs, drafts, num_accepted, emitted)):
            if batch.hidden is not None:   # the positions the target kept: input + accepted
                self._row(batch, i, proposer.capture, req, req.num_computed_tokens - 1,
                          batch.hidden[i:i + 1, :a + 1])
            req.num_computed_tokens += a     # the accepted drafts' KV stays
            req.num_scheduled_outputs += a
            if d:
                req.spec_proposed += len(d)
                req.spec_accepted += a
                req.spec_rate = 0.7 * req.spec_rate + 0.3 * (a / len(d))
                self._proposed.inc(len(d))
                self._accepted.inc(a)
                self._verifies.inc()
                self._emitted.observe(len(e))
            self._row(batch, i, proposer.settle, req)   # after the accounting: KV length final
        batch.emitted = emitted
        last = mx.array([e[-1] for e in emitted], dtype=mx.uint32)
        if self.shared:
            self.ctx.row_batch.tokens = last
        else:
            for i, req in enumerate(reqs):
                req.next_input = last[i:i + 1]

    @staticmethod
    def _row(batch: Batch, i: int, work: Callable[..., None], *args: Any) -> None:
        """One sample row's proposer bookkeeping; a fault there fails that row alone."""
        try:
            work(*args)
        except Exception as e:
            batch.failed.setdefault(batch.sample_rows[i], e)

    # -- acceptance -------------------------------------------------------------------
    def _accept(self, batch: Batch, reqs: list[Request],
                drafts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        width = batch.width
        k = width - 1
        ids = mx.array([(d + [0] * k)[:k] for d in drafts], dtype=mx.int32).reshape(len(reqs), k)
        nd = mx.array([len(d) for d in drafts], dtype=mx.int32)
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
        sampling = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
        out_a: list[int] = [0] * len(reqs)
        out_e: list[list[int]] = [[] for _ in reqs]
        parts = []
        if greedy:
            g = mx.array(greedy, dtype=mx.int32)
            parts.append((greedy, *accept_greedy(batch.target_logprobs[g], ids[g], nd[g])))
        if sampling:
            s = mx.array(sampling, dtype=mx.int32)
            states = [reqs[i].row_state for i in sampling]
            probs = mx.stack([batch.target_probs[i] for i in sampling])
            a, e, keys = accept_sampling(probs, None, ids[s], nd[s], [st.key for st in states])
            for j, st in enumerate(states):
                st.prev_key, st.key = st.key, keys[j]
            parts.append((sampling, a, e))
        mx.eval([x for _, a, e in parts for x in (a, e)])
        for rows, a, e in parts:
            for i, n, toks in zip(rows, a.tolist(), emitted_lists(a, e)):
                out_a[i], out_e[i] = n, toks
        return out_a, out_e

    @staticmethod
    def _report_logprobs(batch: Batch, reqs: list[Request], emitted: list[list[int]]) -> None:
        if not any(r.sampling.logprobs for r in reqs):
            return
        lp = batch.target_logprobs
        width = batch.width
        pad = [(e + [0] * width)[:width] for e in emitted]
        chosen = mx.take_along_axis(lp, mx.array(pad, dtype=mx.int32)[..., None], axis=-1)[..., 0]
        k = max(r.sampling.top_logprobs for r in reqs)
        top_ids = top_vals = None
        if k:
            top = mx.argpartition(-lp, k - 1, axis=-1)[..., :k]
            vals = mx.take_along_axis(lp, top, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            top_ids = mx.take_along_axis(top, order, axis=-1).tolist()
            top_vals = mx.take_along_axis(vals, order, axis=-1).tolist()
        chosen_host = chosen.tolist()
        batch.emitted_logprobs = [row[:len(e)] for row, e in zip(chosen_host, emitted)]
        if k:
            batch.emitted_top = [[list(zip(top_ids[i][j], top_vals[i][j]))
                                  for j in range(len(e))] for i, e in enumerate(emitted)]

    # -- rollback ---------------------------------------------------------------------
    def _rollback(self, batch: Batch, reqs: list[Request], accepted: list[int]) -> None:
        """Keep, per row, the KV of its input token and its accepted drafts; drop the rest."""
        width = batch.width
        drop = [width - 1 - a for a in accepted]
        if not any(drop):
            return
        rows = self.ctx.row_batch
        if self.shared and not rows.solo:
            caches = rows.caches
            batched = True
        elif self.shared:
            caches = rows.caches
            batched = False
        else:
            caches = reqs[0].cache
            batched = False
        if batch.snapshot is None:   # attention only: trim
            if not batched:
                for c in caches:
                    c.trim(drop[0])
                return
            trim_rows(caches, drop)
            drop_shared_padding(caches, len(drop))
            return
        # recurrent layers: restore their state, trim attention to before the forward,
        # and replay each row's input + accepted drafts (right-padded)
        for i, state, lengths, left in batch.snapshot:
            c = caches[i]
            c.cache = state
            c.lengths, c.left_padding = lengths, left
        for c in caches:
            if not isinstance(c, ArraysCache):
                c.trim(width)
        fed = [a + 1 for a in accepted]
        n = max(fed)
        inputs = []
        for i, req in enumerate(reqs):
            base = req.num_computed_tokens - 1   # position of this step's input token
            known = req.prompt_ids + req.output_ids
            seq = ([known[base]] + (batch.drafts or {}).get(batch.sample_rows[i], []))[:fed[i]]
            inputs.append(seq + [0] * (n - len(seq)))
        x = mx.array(inputs, dtype=mx.uint32)
        padding = [n - f for f in fed]
        if batched and max(padding):
            for c in caches:
                if isinstance(c, ArraysCache):
                    c.prepare(lengths=fed)
                else:
                    c.prepare(right_padding=padding)
        elif not batched and n != fed[0]:
            x = x[:, :fed[0]]
        self.model(x, cache=caches)
        if batched and max(padding):
            for c in caches:
                c.finalize()
            drop_shared_padding(caches, len(fed))
        mx.eval([c.state for c in caches])
