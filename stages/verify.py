"""Verify: after a forward that fed each decoding row its input token plus its drafts, accept
the longest prefix of drafts the target agrees with (greedy: equal to its argmax; sampling: the
speculative-sampling rule, so the output is distributed exactly as the target's), emit those
plus the target's own next token, and roll the row store back to what was kept: KV trim for
attention layers (a batched row's surplus becomes left padding), snapshot + replay for
recurrent layers. Engine thread; reads the acceptance back to the host (never pipelined)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from pipeline.adapters import AdapterSet
from pipeline.config import ServeConfig
from pipeline.draft.accept import accept_greedy, accept_sampling, emitted_lists
from pipeline.errors import ConfigError
from pipeline.kv.rows import RowStore, drop_shared_padding
from pipeline.plan import Logits, RowOutput, StepOutput, StepPlan
from pipeline.request import Request
from pipeline.sampler_states import RowSampling
from pipeline.sampling import sampling_logits
from pipeline.stage import StageDeps
from stages.sample import Sample, advance, grammar_failed, top_k


class Verify:
    name: ClassVar[str] = "verify"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.model = deps.model
        self.adapters = AdapterSet.of(deps.model)   # per-row adapters (model.adapters), or None
        self.sampler = Sample(cfg, deps)   # the same logit transforms and per-row states
                                           # (deps.samplers) as one-token sampling
        self.eos_ids = self.sampler.eos_ids
        self._shifts = mx.arange(32, dtype=mx.int32)
        m, label = deps.metrics, cfg.draft.name
        self._proposed = m.spec_proposed.labels(label)
        self._accepted = m.spec_accepted.labels(label)
        self._verifies = m.spec_verifies.labels(label)
        self._emitted = m.spec_emitted.labels(label)
        for c in deps.layout.make_cache(deps.model):
            if isinstance(c, RotatingKVCache) or not (c.is_trimmable() or
                                                      isinstance(c, ArraysCache)):
                raise ConfigError(
                    f"draft={cfg.draft.name} needs KV that can be rolled back; layer type "
                    f"{type(c).__name__} (kv={cfg.kv.name}) cannot be (sliding-window layers "
                    "are not supported with speculative decoding)")

    def __call__(self, logits: Logits, plan: StepPlan, rows: Sequence[Request],
                 kv: RowStore) -> StepOutput:
        out = StepOutput()
        if not rows:
            return out
        reqs = list(rows)
        planned = {r.request_id: r for r in plan.rows}
        drafts = [list(planned[r.request_id].drafts) for r in reqs]
        states = self.sampler.states(reqs, out.failed)
        logprobs, probs = self._distributions(logits, reqs, states, drafts, out.failed)
        num_accepted, emitted = self._accept(logprobs, probs, reqs, states, drafts,
                                             logits.width)
        lps, tops = self._report(logprobs, reqs, emitted, logits.width)
        for i, req in enumerate(reqs):
            out.rows[req.request_id] = RowOutput(
                emitted[i], lps[i] if lps else None, tops[i] if tops else None,
                len(drafts[i]), num_accepted[i])
            if drafts[i]:
                self._proposed.inc(len(drafts[i]))
                self._accepted.inc(num_accepted[i])
                self._verifies.inc()
                self._emitted.observe(len(emitted[i]))
        self._rollback(logits, [planned[r.request_id].start for r in reqs], reqs, drafts,
                       num_accepted, kv)
        kv.set_next(logits.order, mx.array([e[-1] for e in emitted], dtype=mx.uint32))
        return out

    # -- the target's distributions ------------------------------------------------------
    def _distributions(self, logits: Logits, reqs: list[Request], states: list[RowSampling],
                       drafts: list[list[int]], failed: dict[str, BaseException]
                       ) -> tuple[mx.array, dict[int, mx.array]]:
        """The target's distribution at every position, with the same transforms as one-token
        sampling — logit_bias, then logprobs (reported), then truncation and temperature for
        rows that sample. (Rows with penalties never draft: stages/draft.py.)"""
        x = logits.logits
        rows, width, vocab = x.shape
        if any(s.bias_ids for s in states):
            bias = self.sampler.apply_bias(mx.zeros((rows, vocab), dtype=x.dtype), reqs, states)
            x = x + bias[:, None, :]
        if any(r.grammar is not None for r in reqs):
            x = self._constrain(x, reqs, drafts, failed)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        probs = {}
        for i, req in enumerate(reqs):
            if not req.sampling.greedy:
                try:
                    scaled = sampling_logits(logprobs[i], req.sampling, self.eos_ids)
                except Exception as e:   # this row's settings: fail it, keep the others
                    failed.setdefault(req.request_id, e)
                    scaled = logprobs[i]
                probs[i] = mx.softmax(scaled, axis=-1)
        return logprobs, probs

    def _constrain(self, logits: mx.array, reqs: list[Request], drafts: list[list[int]],
                   failed: dict[str, BaseException]) -> mx.array:
        """Grammar rows: position j is masked by the grammar's state after the row's first j
        drafts (free rows pass through)."""
        rows, width, vocab = logits.shape
        words = (vocab + 31) // 32
        host = np.full((rows, width, words), -1, dtype=np.int32)
        for i, req in enumerate(reqs):
            if req.grammar is None:
                continue
            try:
                advance(req)
                req.grammar.draft_masks(drafts[i], host[i])
                bits = host[i].view(np.uint32)
                if not bits[0].any():
                    raise grammar_failed(req)
            except Exception as e:   # this row's grammar: fail it; its mask lets all through
                failed.setdefault(req.request_id, e)
                host[i] = -1
                continue
            for j in range(1, width):
                if not bits[j].any():   # past a draft that ends the grammar: let it stop
                    for t in self.eos_ids:
                        bits[j, t // 32] |= np.uint32(1 << (t % 32))
        shifted = mx.right_shift(mx.array(host)[..., None], self._shifts) & 1
        allowed = shifted.reshape(rows, width, words * 32)[..., :vocab].astype(mx.bool_)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    # -- acceptance -------------------------------------------------------------------
    @staticmethod
    def _accept(logprobs: mx.array, probs: dict[int, mx.array], reqs: list[Request],
                states: list[RowSampling], drafts: list[list[int]], width: int
                ) -> tuple[list[int], list[list[int]]]:
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
            parts.append((greedy, *accept_greedy(logprobs[g], ids[g], nd[g])))
        if sampling:
            s = mx.array(sampling, dtype=mx.int32)
            drawn = [states[i] for i in sampling]
            stacked = mx.stack([probs[i] for i in sampling])
            a, e, keys = accept_sampling(stacked, None, ids[s], nd[s], [st.key for st in drawn])
            for j, st in enumerate(drawn):   # the row's stream goes on after the acceptance
                st.prev_key, st.key = st.key, keys[j]
            parts.append((sampling, a, e))
        mx.eval([x for _, a, e in parts for x in (a, e)])
        for rows, a, e in parts:
            for i, n, toks in zip(rows, a.tolist(), emitted_lists(a, e)):
                out_a[i], out_e[i] = n, toks
        return out_a, out_e

    @staticmethod
    def _report(lp: mx.array, reqs: list[Request], emitted: list[list[int]], width: int
                ) -> tuple[list[list[float]] | None, list[list[list[tuple[int, float]]]] | None]:
        if not any(r.sampling.logprobs for r in reqs):
            return None, None
        pad = [(e + [0] * width)[:width] for e in emitted]
        chosen = mx.take_along_axis(lp, mx.array(pad, dtype=mx.int32)[..., None], axis=-1)[..., 0]
        k = max(r.sampling.top_logprobs for r in reqs)
        lps = [row[:len(e)] for row, e in zip(chosen.tolist(), emitted)]
        if not k:
            return lps, None
        ids, vals = (a.tolist() for a in top_k(lp, k))
        return lps, [[list(zip(ids[i][j], vals[i][j])) for j in range(len(e))]
                     for i, e in enumerate(emitted)]

    # -- rollback ---------------------------------------------------------------------
    def _rollback(self, logits: Logits, starts: list[int], reqs: list[Request],
                  drafts: list[list[int]], accepted: list[int], kv: RowStore) -> None:
        """Keep, per row, the KV of its input token and its accepted drafts; drop the rest."""
        width = logits.width
        drop = [width - 1 - a for a in accepted]
        if not any(drop):
            return
        if logits.snapshot is None:   # attention only: trim
            kv.trim_decode(drop)
            return
        # recurrent layers: restore their state, trim attention to before the forward, and
        # replay each row's input + accepted drafts (right-padded)
        kv.restore(logits.snapshot)
        caches = kv.batch_caches
        for c in caches:
            if not isinstance(c, ArraysCache):
                c.trim(width)
        fed = [a + 1 for a in accepted]
        n = max(fed)
        inputs = []
        for req, start, d, f in zip(reqs, starts, drafts, fed):
            known = req.prompt_ids + req.output_ids   # the input token is on the host
            seq = ([known[start]] + d)[:f]
            inputs.append(seq + [0] * (n - len(seq)))
        x = mx.array(inputs, dtype=mx.uint32)
        padding = [n - f for f in fed]
        batched = not kv.solo
        if batched and max(padding):
            for c in caches:
                if isinstance(c, ArraysCache):
                    c.prepare(lengths=fed)
                else:
                    c.prepare(right_padding=padding)
        elif not batched and n != fed[0]:
            x = x[:, :fed[0]]
        if self.adapters is not None:   # the replay runs each row with its own adapter
            self.adapters.select([self.adapters.slots_of(r.adapter) for r in reqs])
        self.model(x, cache=caches)
        if self.adapters is not None:
            self.adapters.reset()
        if batched and max(padding):
            for c in caches:
                c.finalize()
            drop_shared_padding(caches, len(fed))
        mx.eval([c.state for c in caches])
