"""Prefill: the model forward of each scheduled row — prompt chunks at batch size 1, then
the decode rows together (or one by one at scheduler=serial) — leaving last-position logits
for the rows that sample. Engine thread."""
from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from pipeline.config import ServeConfig
from pipeline.draft.mtp import target_forward
from pipeline.kv.batch import RowBatch, prefill_group
from pipeline.request import Request
from pipeline.stage import Batch, EngineContext


class Prefill:
    """Rows whose scheduled tokens end inside the prompt (all but its last token) are prefill
    chunks: their cache state is evaluated before the step ends, so a long prompt never builds
    one giant deferred graph. Rows at the last prompt token or beyond decode and sample."""

    name: ClassVar[str] = "prefill"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.model = ctx.model
        self.metrics = ctx.metrics
        self.shared = cfg.scheduler.shared_decode
        self.layout = ctx.layout
        self.ctx = ctx
        self.grouped = self.shared and ctx.layout.grouped_prefill and not ctx.keep_hidden
        self.max_width = 1 + cfg.draft.num_draft_tokens
        self.rows = RowBatch()
        ctx.row_batch = self.rows

    def __call__(self, batch: Batch) -> None:
        decode: list[int] = []
        whole: list[Request] = []   # prompts prefilled entirely in this step
        for row, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.num_computed_tokens >= req.num_prompt_tokens:
                decode.append(row)
            elif self.grouped and n == req.num_computed_tokens == req.num_prompt_tokens - 1:
                whole.append(req)
            else:
                self._prefill_chunk(req, n)
        for members in _similar_lengths(whole):
            if len(members) == 1:
                self._prefill_chunk(members[0], members[0].num_prompt_tokens - 1)
            else:
                prefill_group(self.model, members, self._new_cache)
                self.metrics.grouped_prefills.inc(len(members))
        if decode:
            batch.sample_rows = decode
            batch.logits = (self._decode_shared(batch, decode) if self.shared
                            else self._decode_each(batch, decode))   # may reorder sample_rows

    def _prefill_chunk(self, req: Request, n: int) -> None:
        if req.cache is None:
            req.cache = self._new_cache()
        start = req.num_computed_tokens - n
        tokens = mx.array(req.prompt_ids[start:req.num_computed_tokens], dtype=mx.uint32)
        if self.ctx.keep_hidden:   # draft=mtp: the head learns from the trunk's hidden states
            _, hidden = target_forward(self.model, tokens[None], req.cache)
            self.ctx.proposer.capture(req, start, hidden)
            mx.eval([c.state for c in req.cache] + [hidden])
            return
        self.model(tokens[None], cache=req.cache)
        mx.eval([c.state for c in req.cache])

    def _decode_each(self, batch: Batch, decode: list[int]) -> mx.array:
        logits = []
        width = self._width(batch, decode)
        for row in decode:
            req = batch.requests[row]
            if req.cache is None:
                req.cache = self._new_cache()
            tokens = self._first_or_next(req)
            if width > 1:
                tokens = self._with_drafts(tokens[:, None], batch, [row], width)[0]
                batch.snapshot = snapshot(req.cache)
                logits.append(self._forward(batch, tokens[None], req.cache))
            else:
                logits.append(self._forward(batch, tokens[None], req.cache)[:, -1, :])
        return logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)

    def _forward(self, batch: Batch, tokens: mx.array, cache: list) -> mx.array:
        """The decode/verify forward; with draft=mtp its hidden states go on the batch."""
        if not self.ctx.keep_hidden:
            return self.model(tokens, cache=cache)
        logits, hidden = target_forward(self.model, tokens, cache)
        batch.hidden = hidden if batch.hidden is None else mx.concatenate([batch.hidden, hidden])
        return logits

    def _width(self, batch: Batch, decode: list[int]) -> int:
        """1 + the longest draft among the decode rows, rounded up to a power of two (at most
        1 + num_draft_tokens), so verify forwards come in a few shapes; 1 without drafts."""
        if not batch.drafts:
            return 1
        need = 1 + max(len(batch.drafts.get(r, ())) for r in decode)
        batch.width = min(1 << (need - 1).bit_length(), max(self.max_width, need))
        return batch.width

    @staticmethod
    def _with_drafts(first: mx.array, batch: Batch, rows: list[int], width: int) -> mx.array:
        """(rows, 1) next inputs → (rows, width): each row's drafts after its input, padded
        (padding positions are never accepted and are rolled back by verify)."""
        pad = [(batch.drafts.get(r, []) + [0] * width)[:width - 1] for r in rows]
        return mx.concatenate([first.astype(mx.uint32), mx.array(pad, dtype=mx.uint32)],
                              axis=1)

    def _decode_shared(self, batch: Batch, decode: list[int]) -> mx.array:
        rows = self.rows
        reqs = [batch.requests[r] for r in decode]
        firsts = {}
        present = {id(r) for r in rows.rows}
        for req in reqs:
            if id(req) not in present:   # joins now: its next input is known on the host
                if req.cache is None and req.prefill_group is None:
                    req.cache = self._new_cache()
                firsts[req.request_id] = self._known_input(req)
        rows.sync(reqs, firsts)
        where = {id(batch.requests[r]): r for r in decode}
        batch.sample_rows = [where[id(r)] for r in rows.rows]   # logits follow the batch's order
        width = self._width(batch, decode)
        if width > 1:   # verify forward: every position's logits
            tokens = self._with_drafts(rows.tokens[:, None], batch, batch.sample_rows, width)
            batch.snapshot = snapshot(rows.caches)
            return self._forward(batch, tokens, rows.caches)
        return self._forward(batch, rows.tokens[:, None], rows.caches)[:, -1, :]

    def _new_cache(self) -> list:
        return self.layout.make_cache(self.model)

    @classmethod
    def _first_or_next(cls, req: Request) -> mx.array:
        if req.next_input is None:   # first decode step, or resumed from a checkpoint
            return cls._known_input(req)
        return req.next_input

    @staticmethod
    def _known_input(req: Request) -> mx.array:
        """The token at the position this step feeds, from the prompt or replayed output."""
        pos = req.num_computed_tokens - 1
        p = req.num_prompt_tokens
        token = req.prompt_ids[pos] if pos < p else req.output_ids[pos - p]
        return mx.array([token], dtype=mx.uint32)


def snapshot(caches: list) -> list | None:
    """What verify needs to roll back state that cannot be trimmed: each recurrent layer's
    arrays (updates rebind them, so keeping the references is a zero-copy snapshot)."""
    saved = [(i, list(c.cache), getattr(c, "lengths", None), getattr(c, "left_padding", None))
             for i, c in enumerate(caches) if not c.is_trimmable()]
    return saved or None


def _similar_lengths(reqs: list[Request], spread: float = 2.0) -> list[list[Request]]:
    """Groups of prompts whose lengths are within `spread`x of each other, so one padded
    forward wastes at most about half its width on padding."""
    groups: list[list[Request]] = []
    for req in sorted(reqs, key=lambda r: r.num_prompt_tokens):
        if groups and req.num_prompt_tokens <= spread * groups[-1][0].num_prompt_tokens:
            groups[-1].append(req)
        else:
            groups.append([req])
    return groups
