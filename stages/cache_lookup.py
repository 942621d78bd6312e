"""CacheLookup: when a request is admitted, the longest reusable prefix of its prompt from
the prompt cache (or the checkpoint of the identical request, to resume), so only the rest is
computed; the scheduler applies the hit. Engine thread (called at admission)."""
from __future__ import annotations

from typing import Any, ClassVar

from pipeline.config import ServeConfig
from pipeline.plan import CacheHit
from pipeline.request import Request
from pipeline.stage import StageDeps


class CacheLookup:
    name: ClassVar[str] = "cache_lookup"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.cache = deps.prompt_cache
        self.layout = deps.layout

    def __call__(self, req: Request) -> CacheHit | None:
        if self.cache is None:
            return None
        checkpoints = self.cache.checkpoints
        if checkpoints is not None:
            hit = self._resume(req, checkpoints)
            if hit is not None:
                return hit
        found = self.cache.lookup(req.key_ids, req.adapter)
        if found.caches is None:
            return None
        return CacheHit(found.num_tokens, self.layout.adopt(found.caches))

    def _resume(self, req: Request, checkpoints: Any) -> CacheHit | None:
        """The identical request was checkpointed: replay its output and go on from there
        (its KV covers prompt + output[:-1]; the last output token is fed next)."""
        saved = checkpoints.load(req)
        if saved is None or len(saved.output_ids) >= req.sampling.max_tokens:
            return None
        k = len(saved.output_ids)
        return CacheHit(req.num_prompt_tokens + k - 1, self.layout.adopt(saved.caches),
                        tuple(saved.output_ids), saved.key)
