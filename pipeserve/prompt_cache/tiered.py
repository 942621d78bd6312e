"""TieredPromptCache (cache=ssd): the RAM tier in front of the SSD tier. RAM reuse never waits
for a disk write: entries reach disk when RAM evicts them, when they sit idle, when settled
(write-behind, while the engine is idle) and on flush. Engine thread; the SSD writer thread
only writes the bytes this thread encoded."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, ContextManager

from mlx_lm.models.cache import can_trim_prompt_cache

from pipeserve.config import ServeConfig
from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.checkpoint import Checkpoints
from pipeserve.prompt_cache.codec import stage
from pipeserve.prompt_cache.keys import model_key
from pipeserve.prompt_cache.ram import MIN_EXPLAINED, Entry, Lookup, RamPromptCache
from pipeserve.prompt_cache.ssd import SsdStore

log = logging.getLogger(__name__)
SETTLE_S = 0.5           # an entry untouched this long is "settled" for write-behind
TICK_BYTES = 64 << 20    # host bytes encoded per idle tick, so the engine answers promptly


class TieredPromptCache:
    idle_work = True   # write-behind and demotion run in `tick`

    def __init__(self, cfg: ServeConfig, metrics: Metrics, identity: str,
                 max_bytes: int | None = None) -> None:
        ssd = cfg.cache.ssd
        self.metrics = metrics
        self.ram = RamPromptCache(cfg, metrics, max_bytes=max_bytes)
        self.ram.on_evict = self._spill
        self.ssd = SsdStore(Path(ssd.dir).expanduser(), identity, int(ssd.max_gb * (1 << 30)),
                            ssd.verify, metrics)
        self.ssd.write_note({"kv": cfg.kv.name, "model": cfg.model.name})
        self.write_behind = ssd.write_behind
        self.demote_idle_s = ssd.demote_idle_s
        self.dirty: dict[tuple[str, tuple[int, ...]], Entry] = {}   # in RAM, not yet handed to
        # the writer, by Entry.key
        every = cfg.cache.checkpoint_every
        self.checkpoints = (Checkpoints(self.ssd, every, {"identity": identity, "kv": "dense",
                                                           "draft": "none"})
                            if every else None)

    @property
    def entries(self) -> Any:
        return self.ram.entries

    @property
    def nbytes(self) -> int:
        return self.ram.nbytes

    def lookup(self, prompt_ids: list[int], adapter: str | None = None) -> Lookup:
        """As RamPromptCache.lookup, the SSD tier behind it; both keyed by adapter choice."""
        model = model_key(adapter)
        entry, n, reason, shared = self.ram.find(prompt_ids, adapter)
        on_disk = self.ssd.best(prompt_ids, trimmable=True, model=model)
        uncut = False   # a longer entry on disk could not be cut back to the shared prefix
        for _ in range(2):
            if on_disk is None or on_disk[1] <= n:
                break
            restored = self._restore(on_disk[0], on_disk[1], model)
            if restored is not None:
                entry, n = restored, on_disk[1]
                self.metrics.cache_hits.labels("ssd").inc()
                self.metrics.cache_hit_tokens.labels("ssd").inc(n)
                return Lookup(self.ram.take(entry, n), n, "hit")
            if uncut or len(on_disk[0]) == on_disk[1] or (model, on_disk[0]) not in self.ssd.index:
                break   # (no longer indexed: missing or corrupt, counted as such)
            # a longer entry that cannot be cut back (recurrent layers): the longest stored
            # prefix of the prompt instead, as the RAM tier falls back to its shorter entry
            uncut = True
            on_disk = self.ssd.best(prompt_ids, trimmable=False, model=model)
        if entry is None:
            if uncut and reason in ("no_prefix", "evicted"):
                reason = "no_snapshot"
            limit = list(prompt_ids[:-1])
            if (reason in ("no_prefix", "no_snapshot")
                    and self.ssd.foreign.shared(limit, model) > max(shared, MIN_EXPLAINED - 1)):
                reason = "incompatible"
            return self.ram._miss(reason, shared)
        self.metrics.cache_hits.labels("ram").inc()
        self.metrics.cache_hit_tokens.labels("ram").inc(n)
        return Lookup(self.ram.take(entry, n), n, "hit")

    def _restore(self, tokens: tuple[int, ...], n: int, model: str) -> Entry | None:
        caches = self.ssd.load(tokens, model)
        if caches is None:
            return None
        if n < len(tokens) and not can_trim_prompt_cache(caches):
            return None   # (the lookup's miss, if it ends in one, says no_snapshot)
        return self.ram.put_model(list(tokens), caches, model)   # durable already: not dirty

    def put(self, tokens: list[int], caches: list[Any], adapter: str | None = None,
            handed: bool = False) -> None:
        entry = self.ram.put(tokens, caches, adapter, handed)
        if entry is not None and entry.key not in self.ssd.index:
            self.dirty[entry.key] = entry
        for key in [k for k, e in self.dirty.items() if e.key not in self.ram.entries]:
            self.dirty.pop(key)   # subsumed by a longer entry before it reached disk
        self.metrics.cache_dirty.set(len(self.dirty))

    def kept(self, sizes: list[int]) -> int:
        """All that fit the RAM tier: what it evicts is written to the SSD tier."""
        return self.ram.kept(sizes)

    def batch(self) -> ContextManager[None]:
        """The RAM tier's (which spills what it evicts, so each put goes to the device at
        once)."""
        return self.ram.batch()

    def pin(self, tokens: list[int], ttl_s: float, adapter: str | None = None) -> None:
        self.ram.pin(tokens, ttl_s, adapter)

    def evict_oldest(self) -> bool:
        return self.ram.evict_oldest()

    def _write(self, entry: Entry) -> None:
        self.dirty.pop(entry.key, None)
        self.ssd.submit(entry.tokens, stage(list(entry.tokens), entry.caches), entry.model)
        self.metrics.cache_dirty.set(len(self.dirty))

    def _spill(self, entry: Entry) -> None:
        if entry.key not in self.ssd.index or entry.key in self.dirty:
            self._write(entry)
            self.metrics.cache_spills.labels("eviction").inc()

    def tick(self) -> None:
        """Engine idle: write settled dirty entries (bounded work), demote idle ones."""
        now = time.monotonic()
        budget = TICK_BYTES
        if self.write_behind:
            for entry in list(self.dirty.values()):
                if budget <= 0:
                    break
                if now - entry.last_used_s >= SETTLE_S:
                    self._write(entry)
                    budget -= entry.nbytes
        for entry in list(self.ram.entries.values()):
            if now - entry.last_used_s < self.demote_idle_s:
                break   # LRU order: the rest were used more recently
            if entry.key in self.dirty or entry.key not in self.ssd.index:
                self._write(entry)
            self.metrics.cache_spills.labels("idle").inc()
            self.ram.remove(entry)

    def flush(self) -> threading.Event:
        """Hand every dirty entry to the writer; the event is set once all are on disk."""
        t0 = time.perf_counter()
        for entry in list(self.dirty.values()):
            self._write(entry)
        log.info("prompt cache flush: entries handed to the SSD writer in %.3f s",
                 time.perf_counter() - t0)
        return self.ssd.drained()

    def close(self) -> None:
        self.ssd.close()
