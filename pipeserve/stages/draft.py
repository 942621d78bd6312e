"""Draft: before the forward, the proposer (draft.*) offers up to each decoding row's planned
room (`PlannedRow.max_drafts`, counted against the step's token budget) so the target verifies
them in the same forward it decodes with. Rows whose next token depends on host state per
position (repetition/presence/frequency penalties) decode one token as usual in the same batch;
grammar rows draft what their grammar accepts. Engine thread."""
from __future__ import annotations

import logging
from typing import ClassVar

from pipeserve.config import ServeConfig, build
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import Drafts, Logits, PlannedRow, StepOutput, StepPlan
from pipeserve.request import Request
from pipeserve.core.stage import StageDeps

log = logging.getLogger("pipeserve")


def can_draft(req: Request) -> bool:
    """Drafts are verified with per-position distributions computed in one forward; penalties
    would need the history of each drafted position, so those rows don't draft. Grammar rows
    do: their drafts are cut to what the grammar accepts and verify masks every position."""
    return not req.sampling.needs_history


class Draft:
    name: ClassVar[str] = "draft"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.k = cfg.draft.num_draft_tokens
        self.proposer = build(cfg.draft._target_, cfg, deps)
        self.max_context = deps.loaded.max_context

    def __call__(self, plan: StepPlan, kv: RowStore) -> Drafts:
        rows: list[PlannedRow] = []
        limits: list[int] = []
        contexts: list[list[int]] = []
        decoding = plan.decode
        if not any(r.max_drafts for r in decoding):
            return Drafts(sync=False)   # a busy batch decodes plainly (and pipelined)
        for row in decoding:
            req = row.request
            if not can_draft(req) or row.known_input() is None:
                continue   # its input is still on the device: no proposal continues it
            # a row whose drafts keep failing proposes fewer (a verify forward is as wide as
            # its longest draft, and on a compute-bound device every drafted position costs)
            adaptive = max(1, min(self.k, round(self.k * req.spec_rate) + 1))
            limit = min(adaptive, row.max_drafts, self.max_context - row.start - 2)
            if limit > 0:
                rows.append(row)
                limits.append(limit)
                contexts.append((req.prompt_ids + req.output_ids)[:row.start + 1])
        # proposals continue the rows' host tokens: no step may run ahead of them
        if not rows:
            return Drafts(sync=True)
        proposals = self._propose(rows, contexts, limits)
        for i, row in enumerate(rows):
            grammar = row.request.grammar
            if grammar is not None and proposals[i]:
                try:   # (the step advanced the matcher to the row's output)
                    proposals[i] = proposals[i][:grammar.valid_prefix(proposals[i])]
                except Exception as e:   # a draft is only a guess: this row drafts nothing
                    log.warning("grammar could not check drafts of %s: %s",
                                row.request_id, e)
                    proposals[i] = []
        return Drafts({r.request_id: d for r, d in zip(rows, proposals) if d}, sync=True)

    def _propose(self, rows: list[PlannedRow], contexts: list[list[int]],
                 limits: list[int]) -> list[list[int]]:
        """Drafts for `rows`, in one call; if that raises, row by row, so a row whose own
        proposal fails drafts nothing (a draft is only ever a guess: verify keeps the output
        exactly the target's whatever the proposer's state)."""
        reqs = [r.request for r in rows]
        try:
            return self.proposer.propose(reqs, contexts, limits)
        except Exception:
            log.warning("draft proposal for %d row(s) failed; retrying row by row", len(rows),
                        exc_info=True)
            out: list[list[int]] = []
            for req, ctx, limit in zip(reqs, contexts, limits):
                try:
                    out.append(self.proposer.propose([req], [ctx], [limit])[0])
                except Exception:
                    log.warning("draft proposal for %s failed", req.request_id, exc_info=True)
                    self.proposer.release(req)
                    out.append([])
            return out

    def settle(self, plan: StepPlan, logits: Logits, output: StepOutput | None) -> None:
        """After the step is applied (counters final): the proposer keeps what the target
        kept — draft=mtp the hidden states of the positions it kept, draft=model its KV."""
        kept = output.rows if output is not None else {}
        sampled: list[Request] = []
        for row in plan.rows:
            req = row.request
            if row.samples:
                sampled.append(req)
            got = logits.hidden.get(row.request_id)
            if got is None:
                continue
            start, hidden = got
            if row.samples:
                out = kept.get(row.request_id)
                if out is None:
                    continue
                hidden = hidden[:, :out.num_accepted + 1]
            try:
                self.proposer.capture(req, start, hidden)
            except Exception:   # its draft state is unusable: start it over
                log.warning("draft state of %s reset", row.request_id, exc_info=True)
                self.proposer.release(req)
        try:
            self.proposer.settle(sampled)
        except Exception:   # their draft state is unusable: start it over
            log.warning("draft state of %d row(s) reset", len(sampled), exc_info=True)
            for req in sampled:
                self.proposer.release(req)

    def release(self, req: Request) -> None:
        self.proposer.release(req)
