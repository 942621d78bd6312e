"""Draft: before the forward, the proposer (draft.*) offers up to each decoding row's planned
room (`PlannedRow.max_drafts`, counted against the step's token budget) so the target verifies
them in the same forward it decodes with. Rows whose next token depends on host state per
position (repetition/presence/frequency penalties) decode one token as usual in the same batch;
grammar rows draft what their grammar accepts, and append what it forces (fast-forward:
llguidance's forced tokens, verified like drafts, so the output is what sampling gives).
Engine thread."""
from __future__ import annotations

import logging
from typing import ClassVar

from pipeserve.config import ServeConfig, build
from pipeserve.draft.adaptive import DraftLengths
from pipeserve.draft.gate import DraftGate, Report
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import Drafts, Logits, PlannedRow, RowOutput, StepOutput, StepPlan
from pipeserve.request import Request
from pipeserve.core.stage import StageDeps

log = logging.getLogger("pipeserve")


def can_draft(req: Request) -> bool:
    """Drafts are verified with per-position distributions computed in one forward; penalties
    would need the history of each drafted position, so those rows don't draft. Grammar rows
    do: their drafts are cut to what the grammar accepts and verify masks every position."""
    return not req.sampling.needs_history


def decoding_rows(plan: StepPlan) -> int:
    """Rows past their prompt (the batch size draft.disable_by_batch_size and the gate read)."""
    return sum(r.start >= r.request.num_prompt_tokens - 1 for r in plan.decode)


class Draft:
    name: ClassVar[str] = "draft"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.k = cfg.draft.num_draft_tokens
        self.proposes = cfg.draft.proposes
        self.fast_forward = cfg.draft.fast_forward
        self.proposer = build(cfg.draft._target_, cfg, deps)
        self.max_context = deps.loaded.max_context
        # a row whose drafts keep failing proposes fewer, then none for a while (a verify
        # forward is as wide as its longest draft, and a verify step is never pipelined)
        self.lengths = DraftLengths(self.k, cfg.draft.adaptive)
        self._length_metric = (deps.metrics.spec_draft_length.labels(cfg.draft.name)
                               if self.proposes else None)
        self.name = cfg.draft.name
        self.off_above = cfg.draft.disable_by_batch_size if self.proposes else None
        self._off_metric = (deps.metrics.spec_batch_off_steps.labels(cfg.draft.name)
                            if self.proposes else None)
        self._off = False   # the last decode step had more rows than off_above
        # draft.gate: drafting off in batch sizes where its measured goodput loses
        self._metrics = deps.metrics
        self.gate = (DraftGate(cfg.draft.gate_ratio, report=self._gate_report)
                     if cfg.draft.gate and self.proposes else None)

    def __call__(self, plan: StepPlan, kv: RowStore) -> Drafts:
        rows: list[PlannedRow] = []
        limits: list[int] = []
        contexts: list[list[int]] = []
        forced: dict[str, list[int]] = {}
        decoding = plan.decode
        if self.off_above is not None and decoding:
            # rows past their prompt: those the scheduler holds against the threshold
            self._batch_size(decoding_rows(plan))
        if not any(r.max_drafts for r in decoding):
            return Drafts(sync=False)   # a busy batch decodes plainly (and pipelined)
        drafting = next_drafts = self.proposes
        if self.gate is not None:
            n = decoding_rows(plan)
            drafting, next_drafts = self.gate.choose(n), self.gate.next_drafts(n)
        sync = False   # whether a row may draft next step (it then needs this step's tokens)
        for row in decoding:
            req = row.request
            if not can_draft(req):
                continue
            room = min(row.max_drafts, self.max_context - row.start - 2)
            if row.known_input() is not None and (got := self._forced(row, room)):
                forced[row.request_id] = got   # the grammar decides: no proposal needed
                continue
            if not drafting:   # (draft=none, or the gate keeps this batch size plain)
                sync = sync or (next_drafts and self.lengths.drafts_next(row.request_id))
                continue
            chosen = self.lengths.length(row.request_id)   # (a pause counts down every step)
            sync = sync or (next_drafts and self.lengths.drafts_next(row.request_id))
            if row.known_input() is None:
                continue   # its input is still on the device: no proposal continues it
            self._length_metric.observe(chosen)
            limit = min(chosen, self.k, room)
            if limit > 0:
                rows.append(row)
                limits.append(limit)
                contexts.append((req.prompt_ids + req.output_ids)[:row.start + 1])
        if hasattr(self.proposer, "target_store"):
            self.proposer.target_store = kv   # (draft=assistant reads the rows' KV there)
        proposals = self._propose(rows, contexts, limits) if rows else []
        for i, row in enumerate(rows):
            grammar = row.request.grammar
            if grammar is not None and proposals[i]:
                try:   # (the step advanced the matcher to the row's output)
                    proposals[i] = proposals[i][:grammar.valid_prefix(proposals[i])]
                except Exception as e:   # a draft is only a guess: this row drafts nothing
                    log.warning("grammar could not check drafts of %s: %s",
                                row.request_id, e)
                    proposals[i] = []
        tokens = {r.request_id: d for r, d in zip(rows, proposals) if d}
        if not tokens and not forced:   # rows that pause drafting decode pipelined until
            return Drafts(sync=sync)    # they may draft again
        tokens.update(forced)
        # proposals continue the rows' host tokens: no step may run ahead of them
        return Drafts(tokens, sync=True, forced={rid: len(d) for rid, d in forced.items()})

    def _batch_size(self, rows: int) -> None:
        """Count a step the batch size keeps from drafting (the scheduler gave its rows no
        room), and say when drafting turns off or on again."""
        off = rows > self.off_above
        if off:
            self._off_metric.inc()
        if off != self._off:
            self._off = off
            log.info("draft=%s: %d rows decode, %s draft.disable_by_batch_size=%d: drafting %s",
                     self.name, rows, "above" if off else "within", self.off_above,
                     "off" if off else "on again")

    def _forced(self, row: PlannedRow, room: int) -> list[int]:
        """Fast-forward: the tokens the row's grammar forces next (at most draft.fast_forward),
        fed as drafts so verify keeps exactly those the target would pick."""
        grammar = row.request.grammar
        if grammar is None or not self.fast_forward:
            return []
        try:   # (the step advanced the matcher to the row's output)
            return grammar.forced(min(self.fast_forward, room))
        except Exception as e:   # only a shortcut: the row samples as usual
            log.warning("grammar could not fast-forward %s: %s", row.request_id, e)
            return []

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
        follow = True   # whether the proposer takes this step's hidden states
        if self.gate is not None:
            self._measure(plan, kept)
            follow = self.gate.follows(decoding_rows(plan))
        sampled: list[Request] = []
        for row in plan.rows:
            req = row.request
            if row.samples:
                sampled.append(req)
                out = kept.get(row.request_id)
                if out is not None:
                    self.lengths.record(row.request_id, out.num_drafts, out.num_accepted)
            got = logits.hidden.get(row.request_id) if follow else None
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

    def _measure(self, plan: StepPlan, kept: dict[str, RowOutput]) -> None:
        """The gate's sample of this completed step: a plain decode step (every row past its
        prompt) that verified proposed drafts or none, and the tokens it emitted."""
        drafted: bool | None = False
        tokens = 0
        for row in plan.rows:
            if row.start < row.request.num_prompt_tokens - 1:
                drafted = None   # a prompt chunk's step measures no decode
                break
            if row.drafts:
                if row.num_forced:
                    drafted = None   # forced tokens: neither drafting's cost nor plain decode
                    break
                drafted = True
            out = kept.get(row.request_id)
            if out is not None:
                tokens += len(out.token_ids)
        self.gate.record(len(plan.rows), drafted, tokens)

    def _gate_report(self, r: Report) -> None:
        """A bucket met, measured or switched: its gauges, and a log line when it switches."""
        m = self._metrics
        m.spec_gate_open.labels(self.name, r.label).set(1 if r.on else 0)
        m.spec_gate_goodput.labels(self.name, r.label, "draft").set(r.draft_rate)
        m.spec_gate_goodput.labels(self.name, r.label, "plain").set(r.plain_rate)
        if r.like is not None:
            log.info("draft=%s: %s decoding rows: drafting off, as with %s (it lost there; "
                     "probed now and then)", self.name, r.label, r.like)
        if r.switched:
            m.spec_gate_switches.labels(self.name, r.label, "on" if r.on else "off").inc()
            log.info("draft=%s: %s decoding rows: %.0f tok/s drafting, %.0f plain "
                     "(draft.gate_ratio=%.2f): drafting %s", self.name, r.label, r.draft_rate,
                     r.plain_rate, self.gate.ratio, "on again" if r.on else "off")

    def idle(self) -> None:
        """The engine has nothing to run: the gate's next interval starts at the next step."""
        if self.gate is not None:
            self.gate.pause()

    def forget_timings(self) -> None:
        """After the kernel warm-up: its steps' times are kernel builds, not this workload's."""
        if self.gate is not None:
            self.gate.reset()

    def release(self, req: Request) -> None:
        self.lengths.release(req.request_id)
        self.proposer.release(req)
