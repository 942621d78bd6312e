"""Persist: put reusable KV prefixes into the prompt cache — each prompt once its prefill is
done, and each finished request's prompt + output before its KV is freed. Engine thread."""
from __future__ import annotations

from typing import Any, ClassVar

from pipeline.config import ServeConfig
from pipeline.request import FinishReason, Request
from pipeline.stage import Batch, EngineContext


class Persist:
    name: ClassVar[str] = "persist"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.cache = ctx.prompt_cache
        self.ctx = ctx

    def __call__(self, batch: Batch) -> None:
        """After a step: snapshot the prompts whose prefill finished in it (the prefix every
        request with the same system prompt or conversation shares)."""
        if self.cache is None:
            return
        sampling = set(batch.sample_rows)
        for row, req in enumerate(batch.requests):
            done = req.num_computed_tokens == req.num_prompt_tokens - 1
            if row not in sampling and done and req.num_cached_tokens < req.num_computed_tokens:
                caches = self.row_caches(req)
                if caches is not None:
                    self.cache.put(req.prompt_ids[:-1], caches)

    def finished(self, requests: list[Request]) -> None:
        """Before their KV is freed: keep what each finished (or cancelled) row computed."""
        if self.cache is None:
            return
        for req in requests:
            if req.finish_reason is FinishReason.ERROR or req.num_computed_tokens < 1:
                continue
            caches = self.row_caches(req)
            if caches is None:
                continue
            known = req.prompt_ids + req.output_ids
            fed = req.num_computed_tokens   # tokens whose KV is in the caches
            if fed > len(known):            # e.g. the stop token was fed one step ahead
                if not all(c.is_trimmable() for c in caches):
                    continue
                for c in caches:
                    c.trim(fed - len(known))
                fed = len(known)
            self.cache.put(known[:fed], caches)

    def row_caches(self, req: Request) -> list[Any] | None:
        """This row's per-layer caches wherever they live now (own, prefill group, batch)."""
        if req.cache is not None:
            return req.cache
        if req.prefill_group is not None:
            i = req.prefill_group.members.index(req)
            return [layer.extract(i) for layer in req.prefill_group.caches]
        rows = self.ctx.row_batch
        if rows is None or req not in rows.rows:
            return None
        if rows.solo:
            return rows.caches
        i = rows.rows.index(req)
        return [layer.extract(i) for layer in rows.caches]
