"""CacheLookup: when a request is admitted, take the longest reusable prefix of its prompt
from the prompt cache so only the rest is prefilled. Engine thread (called at admission)."""
from __future__ import annotations

from typing import ClassVar

from pipeline.config import ServeConfig
from pipeline.request import Request
from pipeline.stage import EngineContext


class CacheLookup:
    name: ClassVar[str] = "cache_lookup"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.cache = ctx.prompt_cache

    def __call__(self, req: Request) -> None:
        """Admission hook: sets `req.cache` and advances `num_computed_tokens` on a hit."""
        if self.cache is None or req.num_computed_tokens:
            return
        found = self.cache.lookup(req.prompt_ids)
        if found.caches is not None:
            req.cache = found.caches
            req.num_computed_tokens = req.num_cached_tokens = found.num_tokens
