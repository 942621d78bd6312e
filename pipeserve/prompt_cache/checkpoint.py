"""Generation checkpoints (cache.checkpoint_every, cache=ssd): every N emitted tokens a
running request's KV, output so far and sampler key are saved under an identity that covers
everything that decides its tokens, so the identical request after a restart (or a crash)
replays the saved output and goes on from there. Engine thread; the SSD writer writes."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

from pipeserve.prompt_cache.codec import CorruptEntry, decode, stage
from pipeserve.prompt_cache.ssd import SsdStore
from pipeserve.request import Request

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Resume:
    caches: list[Any]       # KV of prompt + output[:-1]: the last output token is fed next
    output_ids: list[int]
    key: list[int] | None   # the sampler's PRNG key when it was saved


class Checkpoints:
    def __init__(self, ssd: SsdStore, every: int, scope: dict[str, str]) -> None:
        self.ssd, self.every, self.scope = ssd, every, scope

    def identity(self, req: Request) -> str:
        """Prompt, every sampling field (seed included), stop strings, constraint, adapter, KV
        scheme, draft method and model: a request differing in any of them never resumes this
        one."""
        sp = dataclasses.asdict(req.sampling)
        sp["logit_bias"] = sorted(sp["logit_bias"].items())
        constraint = getattr(req.constraint, "key", None) if req.constraint is not None else None
        text = json.dumps({"prompt": req.key_ids, "sampling": sp, "constraint": constraint,
                           **({"adapter": req.adapter} if req.adapter is not None else {}),
                           **self.scope}, sort_keys=True, default=str)
        return "c:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def due(self, req: Request) -> bool:
        n = len(req.output_ids)
        return n >= 2 and n - req.checkpointed_tokens >= self.every

    def save(self, req: Request, caches: list[Any], key: list[int] | None,
             kv_tokens: int) -> None:
        """`caches` hold `kv_tokens` >= prompt + output[:-1]; they are trimmed to exactly that."""
        fed = req.num_prompt_tokens + len(req.output_ids) - 1
        extra = kv_tokens - fed
        if extra < 0:
            return
        if extra:
            if not all(c.is_trimmable() for c in caches):
                return   # recurrent state cannot step back: skip this checkpoint
            for c in caches:
                c.trim(extra)
        tokens = req.key_ids + req.output_ids[:-1]
        value = {"kv": stage(tokens, caches), "output_ids": list(req.output_ids), "key": key}
        self.ssd.put_raw(self.identity(req), value)
        self.ssd.metrics.checkpoint_writes.inc()
        req.checkpointed_tokens = len(req.output_ids)

    def load(self, req: Request) -> Resume | None:
        value = self.ssd.get_raw(self.identity(req))
        if not isinstance(value, dict):
            return None
        try:
            tokens, caches = decode(value["kv"], self.ssd.verify)
            outputs = list(value["output_ids"])
            if tokens != req.key_ids + outputs[:-1]:
                raise CorruptEntry("checkpoint tokens do not match its request")
        except (CorruptEntry, KeyError, TypeError) as e:
            log.warning("dropping corrupt checkpoint for %s: %s", req.request_id, e)
            self.ssd.metrics.cache_corrupt.inc()
            self.ssd.delete_raw(self.identity(req))
            return None
        self.ssd.metrics.checkpoint_resumes.inc()
        log.info("resuming %s from a checkpoint at %d output tokens", req.request_id,
                 len(outputs))
        return Resume(caches, outputs, value.get("key"))

    def drop(self, req: Request) -> None:
        self.ssd.delete_raw(self.identity(req))
