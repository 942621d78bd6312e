"""Prefill: the model forward of each scheduled row — a prompt chunk, or the one token a
decode step feeds — leaving last-position logits for the rows that sample. Engine thread."""
from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from pipeline.config import ServeConfig
from pipeline.request import Request
from pipeline.stage import Batch, EngineContext


class Prefill:
    """Rows whose scheduled tokens end inside the prompt (all but its last token) are prefill
    chunks: their cache state is evaluated before the step ends, so a long prompt never builds
    one giant deferred graph. Rows reaching the last prompt token or beyond sample."""

    name: ClassVar[str] = "prefill"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.model = ctx.model

    def __call__(self, batch: Batch) -> None:
        logits: list[mx.array] = []
        for row, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.cache is None:
                req.cache = make_prompt_cache(self.model)
            tokens = self._input_ids(req, n)
            out = self.model(tokens[None], cache=req.cache)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                batch.sample_rows.append(row)
                logits.append(out[:, -1, :])
            else:
                mx.eval([c.state for c in req.cache])
        if logits:
            batch.logits = logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)

    @staticmethod
    def _input_ids(req: Request, n: int) -> mx.array:
        """Token ids at positions [computed - n, computed): prompt ids, then the token the
        previous step sampled (still lazy while that step is in flight)."""
        end = req.num_computed_tokens
        start = end - n
        p = req.num_prompt_tokens
        if end <= p:
            return mx.array(req.prompt_ids[start:end], dtype=mx.uint32)
        assert n == 1 and start == end - 1, "decode feeds exactly one token"
        if start == p - 1:
            return mx.array(req.prompt_ids[-1:], dtype=mx.uint32)
        return req.next_input
