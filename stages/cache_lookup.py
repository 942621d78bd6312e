"""CacheLookup: when a request is admitted, take the longest reusable prefix of its prompt
from the prompt cache so only the rest is prefilled. Engine thread (called at admission)."""
from __future__ import annotations

from typing import Any, ClassVar

from pipeline.config import ServeConfig
from pipeline.request import Request
from pipeline.stage import EngineContext


class CacheLookup:
    name: ClassVar[str] = "cache_lookup"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.cache = ctx.prompt_cache
        self.layout = ctx.layout

    def __call__(self, req: Request) -> None:
        """Admission hook: sets `req.cache` and advances `num_computed_tokens` on a hit."""
        if self.cache is None or req.num_computed_tokens:
            return
        checkpoints = getattr(self.cache, "checkpoints", None)
        if checkpoints is not None and self._resume(req, checkpoints):
            return
        found = self.cache.lookup(req.prompt_ids)
        if found.caches is not None:
            req.cache = self.layout.adopt(found.caches)
            req.num_computed_tokens = req.num_cached_tokens = found.num_tokens

    def _resume(self, req: Request, checkpoints: Any) -> bool:
        """The identical request was checkpointed: replay its output and go on from there."""
        saved = checkpoints.load(req)
        if saved is None or len(saved.output_ids) >= req.sampling.max_tokens:
            return False
        k = len(saved.output_ids)
        req.cache = self.layout.adopt(saved.caches)
        req.output_ids = list(saved.output_ids)
        req.num_computed_tokens = req.num_prompt_tokens + k - 1   # the last output is fed next
        req.num_scheduled_outputs = k
        req.num_cached_tokens = req.num_prompt_tokens - 1
        req.replay_ids = list(saved.output_ids)
        req.resume_key = saved.key
        req.checkpointed_tokens = k
        return True
