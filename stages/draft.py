"""Draft: before the forward, the proposer (draft.*) offers up to `num_draft_tokens` tokens for
each decode row, so the target verifies them in the same forward it decodes with. Rows whose
next token depends on host state per position (repetition/presence/frequency penalties,
structured-output grammars) decode one token as usual in the same batch. Engine thread."""
from __future__ import annotations

import logging
from typing import ClassVar

from pipeline.config import ServeConfig, build
from pipeline.request import Request
from pipeline.stage import Batch, EngineContext

log = logging.getLogger("pipeserve")


def can_draft(req: Request) -> bool:
    """Drafts are verified with per-position distributions computed in one forward; penalties
    would need the history of each drafted position, so those rows don't draft. Grammar rows
    do: their drafts are cut to what the grammar accepts and verify masks every position."""
    return not req.sampling.needs_history


class Draft:
    name: ClassVar[str] = "draft"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.k = cfg.draft.num_draft_tokens
        self.max_rows = cfg.draft.disable_by_batch_size
        self.proposer = build(cfg.draft._target_, cfg, ctx)
        ctx.proposer = self.proposer
        self.metrics = ctx.metrics
        self.max_context = ctx.loaded.max_context

    def __call__(self, batch: Batch) -> None:
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests)
        if self.max_rows is not None and decoding > self.max_rows:
            return   # a busy batch decodes plainly (and pipelined): drafts would cost more
        rows: list[int] = []
        limits: list[int] = []
        for row, req in enumerate(batch.requests):
            if req.num_computed_tokens < req.num_prompt_tokens:
                continue   # a prefill chunk
            # proposals continue the row's host tokens: no step may run ahead of them
            batch.sync = True
            if not can_draft(req):
                continue
            # never draft past max_tokens or the context: the row emits at most k + 1 tokens;
            # a row whose drafts keep failing proposes fewer (a verify forward is as wide as
            # its longest draft, and on a compute-bound device every drafted position costs)
            adaptive = max(1, min(self.k, round(self.k * req.spec_rate) + 1))
            limit = min(adaptive, req.sampling.max_tokens - req.num_scheduled_outputs,
                        self.max_context - req.num_computed_tokens - 1)
            if limit > 0:
                rows.append(row)
                limits.append(limit)
        if not rows:
            return
        proposals = self._propose(batch, rows, limits)
        for i, r in enumerate(rows):
            grammar = batch.requests[r].grammar
            if grammar is not None and proposals[i]:
                try:
                    grammar.advance(batch.requests[r].output_ids)
                    proposals[i] = proposals[i][:grammar.valid_prefix(proposals[i])]
                except Exception as e:   # this row's grammar: the row fails, alone
                    batch.failed.setdefault(r, e)
                    proposals[i] = []
        drafts = {r: d for r, d in zip(rows, proposals) if d}
        batch.drafts = drafts or None

    def _propose(self, batch: Batch, rows: list[int], limits: list[int]) -> list[list[int]]:
        """Drafts for `rows`, in one call; if that raises, row by row, so only the rows whose
        own proposal fails are failed (a draft is only ever a guess: verify keeps the output
        exactly the target's whatever the proposer's state)."""
        reqs = [batch.requests[r] for r in rows]
        try:
            return self.proposer.propose(reqs, limits)
        except Exception:
            log.warning("draft proposal for %d row(s) failed; retrying row by row", len(rows),
                        exc_info=True)
            out: list[list[int]] = []
            for r, req, limit in zip(rows, reqs, limits):
                try:
                    out.append(self.proposer.propose([req], [limit])[0])
                except Exception as e:
                    batch.failed.setdefault(r, e)
                    out.append([])
            return out
