"""Prefill: the model forward of each scheduled row — prompt chunks at batch size 1, then
the decode rows together (or one by one at scheduler=serial) — leaving last-position logits
for the rows that sample. Engine thread."""
from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from pipeline.config import ServeConfig
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
        self.rows = RowBatch()
        ctx.row_batch = self.rows

    def __call__(self, batch: Batch) -> None:
        decode: list[int] = []
        whole: list[Request] = []   # prompts prefilled entirely in this step
        for row, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.num_computed_tokens >= req.num_prompt_tokens:
                decode.append(row)
            elif self.shared and n == req.num_computed_tokens == req.num_prompt_tokens - 1:
                whole.append(req)
            else:
                self._prefill_chunk(req, n)
        for members in _similar_lengths(whole):
            if len(members) == 1:
                self._prefill_chunk(members[0], members[0].num_prompt_tokens - 1)
            else:
                prefill_group(self.model, members, lambda: make_prompt_cache(self.model))
                self.metrics.grouped_prefills.inc(len(members))
        if decode:
            batch.sample_rows = decode
            batch.logits = (self._decode_shared(batch, decode) if self.shared
                            else self._decode_each(batch, decode))   # may reorder sample_rows

    def _prefill_chunk(self, req: Request, n: int) -> None:
        if req.cache is None:
            req.cache = make_prompt_cache(self.model)
        start = req.num_computed_tokens - n
        tokens = mx.array(req.prompt_ids[start:req.num_computed_tokens], dtype=mx.uint32)
        self.model(tokens[None], cache=req.cache)
        mx.eval([c.state for c in req.cache])

    def _decode_each(self, batch: Batch, decode: list[int]) -> mx.array:
        logits = []
        for row in decode:
            req = batch.requests[row]
            if req.cache is None:
                req.cache = make_prompt_cache(self.model)
            logits.append(self.model(self._first_or_next(req)[None], cache=req.cache)[:, -1, :])
        return logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)

    def _decode_shared(self, batch: Batch, decode: list[int]) -> mx.array:
        rows = self.rows
        reqs = [batch.requests[r] for r in decode]
        firsts = {}
        present = {id(r) for r in rows.rows}
        for req in reqs:
            if id(req) not in present:   # joins now: its next input is known on the host
                if req.cache is None and req.prefill_group is None:
                    req.cache = make_prompt_cache(self.model)
                firsts[req.request_id] = self._known_input(req)
        rows.sync(reqs, firsts)
        where = {id(batch.requests[r]): r for r in decode}
        batch.sample_rows = [where[id(r)] for r in rows.rows]   # logits follow the batch's order
        return self.model(rows.tokens[:, None], cache=rows.caches)[:, -1, :]

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
