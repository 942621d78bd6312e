"""Verify: after a forward that fed each decoding row its input token plus its drafts, position
j of a row holds the target's logits after its first j drafts. The configured sample stage
(the same value plain decoding uses) picks the target's token at each position exactly as a
plain step would there; a row keeps its drafts while they equal those picks and emits the pick
at the first one that differs (or after its last draft). So whatever the sample stage does —
greedy, seeded sampling, a third-party rule — the output is what it gives without drafts.
The built-in sampler's per-row state (deps.samplers) is rewound to the last kept position, so
a seeded row draws exactly the keys it would without drafts: the same tokens, not only the
same distribution (for one-token drafts this accepts as often as speculative sampling). Then
one call rolls the row store back to what was kept. Engine thread; reads the picks back to the
host (never pipelined)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from pipeserve.config import ServeConfig
from pipeserve.errors import ConfigError
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import Logits, RowOutput, Sampled, StepOutput, StepPlan
from pipeserve.request import Request
from pipeserve.core.sampler_states import RowSampling, SamplerStates
from pipeserve.core.stage import Sample, StageDeps
from pipeserve.kv.rotating import is_rotating


@dataclass(slots=True)
class _Picks:
    """One row's picks by position (0 .. the last position it was asked about)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    failed: list[tuple[int, BaseException]] = field(default_factory=list)
    marks: list[RowSampling | None] = field(default_factory=list)   # its state after each pick


class Verify:
    name: ClassVar[str] = "verify"

    def __init__(self, cfg: ServeConfig, deps: StageDeps, sample: Sample) -> None:
        self.sample = sample   # the step's one sample stage, shared with plain decoding
        self.samplers: SamplerStates | None = deps.samplers   # its rows' state (rewound)
        m, label = deps.metrics, cfg.draft.name
        self._proposed = m.spec_proposed.labels(label)
        self._accepted = m.spec_accepted.labels(label)
        self._verifies = m.spec_verifies.labels(label)
        self._emitted = m.spec_emitted.labels(label)
        self._forwarded = m.fast_forward_tokens
        for c in deps.layout.make_cache(deps.model):
            # sliding-window layers: a verify's multi-token update never overwrites what
            # its rollback needs (pipeserve/kv/rotating.py)
            if not (c.is_trimmable() or isinstance(c, ArraysCache) or is_rotating(c)):
                raise ConfigError(
                    f"draft={cfg.draft.name} needs KV that can be rolled back; layer type "
                    f"{type(c).__name__} (kv={cfg.kv.name}) cannot be")

    def __call__(self, logits: Logits, plan: StepPlan, rows: Sequence[Request],
                 kv: RowStore) -> StepOutput:
        out = StepOutput()
        if not rows:
            return out
        reqs = list(rows)
        planned = {r.request_id: r for r in plan.rows}
        decode = [planned[r.request_id] for r in reqs]
        drafts = [list(p.drafts) for p in decode]
        picks = self._picks(logits, reqs, drafts)
        kept: dict[str, int] = {}
        for req, d, p in zip(reqs, drafts, picks):
            n = 0   # drafts kept: while each equals the pick at its position
            while n < len(p.token_ids) - 1 and d[n] == p.token_ids[n]:
                n += 1
            rid = req.request_id
            kept[rid] = n
            forced = planned[rid].num_forced   # (a grammar's tokens: not a proposer's)
            out.rows[rid] = RowOutput(p.token_ids[:n + 1],
                                      p.logprobs[:n + 1] if p.logprobs is not None else None,
                                      p.top[:n + 1] if p.top is not None else None,
                                      len(d) - forced, n, min(n, forced))
            for j, e in p.failed:   # a failure counts where the row really got to
                if j <= n:
                    out.failed.setdefault(rid, e)
            if self.samplers is not None and n < len(p.marks) - 1:
                self.samplers.rewind(rid, p.marks[n])
            if forced:
                self._forwarded.inc(min(n, forced))
            if len(d) > forced:
                self._proposed.inc(len(d) - forced)
                self._accepted.inc(max(0, n - forced))
                self._verifies.inc()
                self._emitted.observe(n + 1)
        kv.rollback(decode, kept)
        return out

    def _picks(self, logits: Logits, reqs: list[Request], drafts: list[list[int]]
               ) -> list[_Picks]:
        """The sample stage's pick at every position a row may reach: one call per position
        j, over the rows whose first j drafts may all be kept, with their logits there; a
        grammar row's matcher stands after those j drafts for the call (and returns after)."""
        reach = [len(d) for d in drafts]
        ahead = [0] * len(reqs)
        for i, req in enumerate(reqs):
            if req.grammar is not None and drafts[i]:
                try:
                    reach[i] = req.grammar.valid_prefix(drafts[i])
                except Exception:   # its matcher cannot say: position 0 only (sample fails it)
                    reach[i] = 0
        calls: list[tuple[list[int], Sampled, list[RowSampling | None]]] = []
        try:
            for j in range(max(reach) + 1):
                for i, req in enumerate(reqs):
                    if j and req.grammar is not None and reach[i] >= j:
                        if not req.grammar.look_ahead(drafts[i][j - 1]):
                            reach[i] = j - 1   # its grammar cannot go past this draft (a
                            continue           # parser limit): the row stops here
                        ahead[i] += 1
                        if req.grammar.is_terminated():   # only a stop may follow: no further
                            reach[i] = j - 1
                idx = [i for i in range(len(reqs)) if reach[i] >= j]
                if not idx:
                    break
                x = (logits.logits[:, j] if len(idx) == len(reqs)
                     else logits.logits[mx.array(idx, dtype=mx.int32), j])
                view = Logits([logits.order[i] for i in idx], x)
                picked = self.sample(view, [reqs[i] for i in idx])
                marks = [self.samplers.mark(reqs[i].request_id) if self.samplers else None
                         for i in idx]
                calls.append((idx, picked, marks))
        finally:
            for i, n in enumerate(ahead):
                if n:
                    reqs[i].grammar.back(n)
        mx.eval([a for _, s, _ in calls for a in s.arrays()])
        return _gather(calls, reqs)


def _gather(calls: list[tuple[list[int], Sampled, list[RowSampling | None]]],
            reqs: list[Request]) -> list[_Picks]:
    """Host copies of each call's picks (and the rows' sampler states after it), by row and
    position."""
    picks = [_Picks() for _ in reqs]
    for j, (idx, s, marks) in enumerate(calls):
        ids = s.token_ids.tolist()
        lps = s.logprobs.tolist() if s.logprobs is not None else None
        top = ([list(zip(t, v)) for t, v in zip(s.top_ids.tolist(), s.top_logprobs.tolist())]
               if s.top_ids is not None else None)
        for k, i in enumerate(idx):
            p = picks[i]
            p.token_ids.append(ids[k])
            p.marks.append(marks[k])
            if lps is not None:
                p.logprobs = (p.logprobs or []) + [lps[k]]
            if top is not None:
                p.top = (p.top or []) + [top[k]]
            e = s.failed.get(reqs[i].request_id)
            if e is not None:
                p.failed.append((j, e))
    return picks
