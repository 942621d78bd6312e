"""CacheLookup: when a request is admitted, the longest reusable prefix of its prompt from
the prompt cache (or the checkpoint of the identical request, to resume), so only the rest is
computed. A query: it returns the hit, the checkpoint positions the row still needs and why
what it could not reuse is recomputed (`cache_miss`, pipeserve/prompt_cache/explain.py) as a
LookupResult, and the scheduler applies them to the request. Engine thread (called at
admission)."""
from __future__ import annotations

from typing import Any, ClassVar

from pipeserve.config import ServeConfig
from pipeserve.core.plan import CacheHit, LookupResult
from pipeserve.prompt_cache.explain import explain
from pipeserve.prompt_cache.protocol import rewinds
from pipeserve.prompt_cache.ram import Lookup
from pipeserve.request import Request
from pipeserve.core.stage import StageDeps


GPU_MIN_REUSE = 256   # cache.min_reuse_tokens unset, on a GPU


def min_reuse(cfg: ServeConfig) -> int:
    """cache.min_reuse_tokens, or its device default when unset."""
    if not cfg.cache.enabled:
        return 0
    if cfg.cache.min_reuse_tokens is not None:
        return cfg.cache.min_reuse_tokens
    import mlx.core as mx
    return GPU_MIN_REUSE if mx.default_device().type == mx.DeviceType.gpu else 0


class CacheLookup:
    name: ClassVar[str] = "cache_lookup"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.cache = deps.prompt_cache
        self.layout = deps.layout
        self.metrics = deps.metrics
        # pins expire by each rank's clock: a distributed group's ranks would evict unalike
        self.pins = cfg.distributed.name == "none"
        self.decode = deps.loaded.tokenizer.decode   # the text around a divergence
        self.trimmable = rewinds(deps.model)   # then no state is needed at a marked position
        self.min_reuse = min_reuse(cfg)

    def __call__(self, req: Request) -> LookupResult:
        keep = req.checkpoints_at
        if self.cache is None:
            return LookupResult(None, keep, req.cache_miss)
        checkpoints = self.cache.checkpoints
        if checkpoints is not None:
            hit = self._resume(req, checkpoints)
            if hit is not None:
                return LookupResult(hit, keep, req.cache_miss)
        for at, ttl_s in req.pins if self.pins else ():   # cache_control: kept from eviction
            self.cache.pin(req.key_ids[:at], ttl_s, req.adapter)
        if req.num_prompt_tokens - 1 < self.min_reuse:   # no hit it could take: not looked up
            return LookupResult(None, () if self.trimmable else keep, req.cache_miss)
        found = self.cache.lookup(req.key_ids, req.adapter)
        if found.caches is not None and found.num_tokens < self.min_reuse:
            found = Lookup(None, 0, "short")   # cache.min_reuse_tokens: cheaper to compute
        reused = found.num_tokens if found.caches is not None else 0
        # a cache that can trim serves any prefix of a longer entry: no state to keep at the
        # history boundary; one that cannot (recurrent layers) keeps it unless reused past it
        if self.trimmable:
            keep = ()
        else:
            keep = tuple(p for p in keep if reused < p < req.num_prompt_tokens - 1)
        miss = explain(self.cache, req.key_ids, req.adapter, reused, self.decode)
        if miss is not None:
            self.metrics.cache_miss_reasons.labels(miss["reason"]).inc()
        hit = (CacheHit(found.num_tokens, self.layout.adopt(found.caches))
               if found.caches is not None else None)
        return LookupResult(hit, keep, miss)

    def _resume(self, req: Request, checkpoints: Any) -> CacheHit | None:
        """The identical request was checkpointed: replay its output and go on from there
        (its KV covers prompt + output[:-1]; the last output token is fed next)."""
        saved = checkpoints.load(req)
        if saved is None or len(saved.output_ids) >= req.sampling.max_tokens:
            return None
        k = len(saved.output_ids)
        return CacheHit(req.num_prompt_tokens + k - 1, self.layout.adopt(saved.caches),
                        tuple(saved.output_ids), saved.key)
