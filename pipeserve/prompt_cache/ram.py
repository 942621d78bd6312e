"""RamPromptCache: KV prefixes in a token trie (trie.py) with a byte-capped LRU.
An entry owns its arrays (`own`: a copy of exactly the tokens it holds, never a view that would
keep a running batch's or a preallocated buffer alive; a finished row's buffers, freed right
after, are handed over instead of copied), and counts their bytes; the entries of rows copied
together share one block (`Block`: views of one gather a layer), counted once while any of
them is held. A hit lends the
entry's arrays (new array objects over the same buffers, no copy); the borrower's first write
copies, so the entry stays intact. Both go through the caches' `state` / `from_state`
(pipeserve/prompt_cache/protocol.py). Engine thread only."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import mlx.core as mx
from mlx_lm.models.cache import (CacheList, KVCache, PromptTrieResult,
                                  can_trim_prompt_cache)

from pipeserve.config import ServeConfig
from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.config import RAM_FLOOR_GB
from pipeserve.prompt_cache.keys import TRIE_KEY, GhostIndex, model_key
from pipeserve.prompt_cache.protocol import (Block, SharedKVCache, content_state, lend,
                                             lend_prefix, rebuild)
from pipeserve.prompt_cache.trie import TokenTrie

if TYPE_CHECKING:
    from pipeserve.memory import MemoryModel
    from pipeserve.prompt_cache.checkpoint import Checkpoints

log = logging.getLogger(__name__)
MAX_PINS = 4096      # pinned prefixes remembered at once
FLOOR_BYTES = int(RAM_FLOOR_GB * (1 << 30))   # the fitted RAM tier's least size
MIN_EXPLAINED = 16   # shared tokens that make a miss "evicted" / "incompatible" rather than none


def own(layer: Any, pending: list[mx.array], handed: bool = False) -> tuple[Any, int]:
    """(a copy of `layer` holding only its content, the bytes that copy keeps alive); the new
    arrays are appended to `pending`, for the caller to evaluate.

    A row's cache usually points into something larger than what it holds: a slice of a
    batched cache B rows wide (`extract`), or a buffer preallocated in steps of 256 tokens. A
    view keeps that whole buffer alive, and so does a lazy array (its graph holds its inputs).
    So every array of its state is copied to a buffer of its own (`mx.contiguous` of a view
    copies it; an array that is a whole buffer is shared as it is), and the copy is rebuilt
    with `from_state`. Layouts that point into a shared block pool (kv=paged) are lent: the
    pool holds them.

    `handed`: the caller hands over a plain KVCache whose buffers only it holds and that
    nothing writes again (a finished row's, freed right after): the entry keeps views of its
    content in those buffers, no copy, and counts the whole buffers' bytes, when their room
    past the content (preallocated, up to 255 tokens) is at most an eighth of it; a short
    row's is copied, so short entries do not count 256 tokens each. MLX never writes a shared
    buffer in place, so even a later write could not reach the entry."""
    if handed and isinstance(layer, SharedKVCache):   # views of a block (`copies_of`'s):
        kept = KVCache()   # the entry counts the block once (RamPromptCache._charge), and
        kept.keys, kept.values, kept.offset = layer.keys, layer.values, layer.offset
        if not layer.block.queued:   # its arrays go to the device once; the views stay lazy
            layer.block.queued = True
            pending.extend(layer.block.arrays)
        return kept, layer.keys.nbytes + layer.values.nbytes
    if handed and type(layer) is KVCache and layer.keys is not None \
            and layer.keys.shape[2] == layer.offset:   # exactly its content (`copy_of`'s)
        kept = KVCache()   # new array objects (as `lend`): a slice update rebinds the old ones
        kept.keys, kept.values, kept.offset = layer.keys[...], layer.values[...], layer.offset
        pending.extend((kept.keys, kept.values))
        return kept, layer.keys.nbytes + layer.values.nbytes
    if handed and type(layer) is KVCache and layer.keys is not None \
            and 8 * (layer.keys.shape[2] - layer.offset) <= layer.offset:
        state = content_state(layer)
        pending.extend(a for a in state if isinstance(a, mx.array))
        return type(layer).from_state(state), layer.keys.nbytes + layer.values.nbytes
    if hasattr(layer, "portable"):
        return lend(layer), layer.nbytes
    if isinstance(layer, CacheList):   # caches of caches (mlx-lm's composite layers)
        owned = [own(c, pending) for c in layer.caches]
        return CacheList(*(c for c, _ in owned)), sum(n for _, n in owned)
    nbytes = 0

    def keep(arr: mx.array) -> mx.array:
        nonlocal nbytes
        arr = mx.contiguous(arr)
        pending.append(arr)
        nbytes += arr.nbytes
        return arr

    return rebuild(layer, keep, content_state(layer)), nbytes


def _plain(layer: SharedKVCache) -> KVCache:
    """A block's row as a plain cache over the same views (`own` then copies it)."""
    c = KVCache()
    c.keys, c.values, c.offset = layer.keys, layer.values, layer.offset
    return c


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    caches: list[Any]       # per layer; never written (borrowers get `lend` copies)
    nbytes: int             # bytes of the arrays `caches` keep alive (see `own`)
    trimmable: bool         # attention-only: any prefix of it can be reused
    last_used_s: float = field(default_factory=time.monotonic)
    model: str = TRIE_KEY   # its adapter's trie root (model_key)
    block: Block | None = None   # the arrays it shares with other rows' entries (views of)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.model, self.tokens)


@dataclass(slots=True)
class _Live:
    """A block some entries share, and which of them are still held (by key)."""

    block: Block
    entries: dict[tuple[str, tuple[int, ...]], Entry] = field(default_factory=dict)
    # less than half of it is used: its entries are counted by their own bytes and copied out
    # of it when the `batch()` it happened in ends (by then its other entries may be gone too)
    leaving: bool = False


@dataclass(slots=True)
class Lookup:
    caches: list[Any] | None   # lent per-layer caches holding `num_tokens` tokens, or None
    num_tokens: int
    reason: str                # "hit", or why nothing was reused


class PromptCache(Protocol):
    """What the step and its stages use of a prompt cache (cache=ram, cache=ssd); every
    member is there on every tier, so nothing probes for one."""

    checkpoints: Checkpoints | None   # generation checkpoints (cache.checkpoint_every), or None
    idle_work: bool                   # `tick` has work to do while the engine is idle

    def lookup(self, prompt_ids: list[int], adapter: str | None = None) -> Lookup: ...

    def put(self, tokens: list[int], caches: list[Any], adapter: str | None = None,
            handed: bool = False) -> Any: ...

    def tick(self) -> None: ...

    def kept(self, sizes: list[int]) -> int: ...   # of entries put in a row, how many it holds

    def batch(self) -> ContextManager[None]: ...   # the puts inside: one device call

    def evict_oldest(self) -> bool: ...   # room for live rows: their KV before cached prefixes

    def flush(self) -> threading.Event: ...

    def close(self) -> None: ...


def fit_ram_bytes(ram_gb: float | None, memory: MemoryModel | None) -> tuple[int, str]:
    """The RAM tier's byte cap and why: `cache.ram_gb` when set; else two entries of the
    longest context the server takes (an agent's whole context and the one it replaces), at
    least FLOOR_BYTES, at most a quarter of the device memory the weights leave, so a long
    prompt's repeat is a hit on a device with room for it."""
    if ram_gb is not None:
        return int(ram_gb * (1 << 30)), "cache.ram_gb"
    if memory is None:
        return FLOOR_BYTES, "the default"
    want = 2 * memory.kv_bytes(memory.max_context)
    room = max(memory.device_bytes - memory.weight_bytes, 0) // 4
    fitted = max(FLOOR_BYTES, min(want, room))
    why = ("two %d-token entries" % memory.max_context if fitted == want
           else "a quarter of the memory the weights leave" if fitted == room
           else "the least fitted size")
    return fitted, f"fitted: {why}"


class RamPromptCache:
    tier = "ram"
    checkpoints: Checkpoints | None = None   # RAM only: no generation checkpoints
    idle_work = False

    def __init__(self, cfg: ServeConfig, metrics: Metrics, identity: str = "",
                 max_bytes: int | None = None) -> None:
        """`max_bytes`: the byte cap fitted at load (fit_ram_bytes); None: cache.ram_gb, or
        the floor when that is unset."""
        self.max_bytes = (max_bytes if max_bytes is not None
                          else fit_ram_bytes(cfg.cache.ram_gb, None)[0])
        self.metrics = metrics
        self._warned_size = False   # a prefix larger than the tier: said once, then counted
        metrics.cache_capacity.labels(self.tier).set(self.max_bytes)
        self.on_evict: Callable[[Entry], None] | None = None   # the SSD tier's spill hook
        self._batch: list[mx.array] | None = None   # inside `batch()`: the puts' new arrays
        self.trie = TokenTrie()
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], Entry] = OrderedDict()  # LRU
        # order, keyed by Entry.key (adapter root, tokens)
        self.nbytes = 0   # what its entries hold: each its own bytes, a shared block once
        self._blocks: dict[int, _Live] = {}   # the blocks its entries share, by id
        self.ghosts = GhostIndex()   # token keys of recently evicted entries: explains misses
        self.pins: dict[tuple[str, tuple[int, ...]], float] = {}   # (root, tokens) → until
        # the last trie search (root, query, answer), until the trie changes: a partial hit's
        # explanation (explain.py) asks what its lookup just asked
        self._searched: tuple[str, list[int], PromptTrieResult] | None = None

    def search(self, model: str, query: list[int]) -> PromptTrieResult:
        """The trie's answer for `query` under root `model` (the last one again, while the
        trie is unchanged, without a second walk over the query)."""
        memo = self._searched
        if memo is not None and memo[0] == model and memo[1] == query:
            return memo[2]
        found = self.trie.search(model, query)
        self._searched = (model, query, found)
        return found

    def find(self, prompt_ids: list[int], adapter: str | None = None
             ) -> tuple[Entry | None, int, str, int]:
        """(entry, tokens reusable from it, reason, tokens shared with any entry), among the
        entries made with the same adapter choice (Request.adapter)."""
        model = model_key(adapter)
        limit = len(prompt_ids) - 1
        query = list(prompt_ids[:limit])
        if limit < 1 or not self.entries:
            evicted = limit >= 1 and self.ghosts.shared(query, model) >= MIN_EXPLAINED
            return None, 0, "evicted" if evicted else "no_prefix", 0
        exact = self.entries.get((model, tuple(query)))
        if exact is not None:   # an exact repeat: a hash of the query, no walk of the trie
            return exact, limit, "hit", limit
        found = self.search(model, query)
        best: tuple[Entry, int] | None = None
        if found.shorter is not None:
            best = (self.entries[(model, tuple(found.shorter))], len(found.shorter))
        if found.longer is not None and found.common_prefix > (best[1] if best else 0):
            longer = self.entries[(model, tuple(found.longer))]
            # a row that converted to a quantized layout at C (kv.quantized_start) is never
            # reused below C: a cold run would still be dense there
            converted = max((getattr(c, "converted_at", None) or 0) for c in longer.caches)
            if longer.trimmable and found.common_prefix >= converted:
                best = (longer, found.common_prefix)
        shared = max(found.common_prefix, best[1] if best else 0)
        if best is None:
            if self.ghosts.shared(query, model) > max(shared, MIN_EXPLAINED - 1):
                return None, 0, "evicted", shared
            return None, 0, "no_snapshot" if shared else "no_prefix", shared
        return best[0], best[1], "hit", shared

    def take(self, entry: Entry, n: int) -> list[Any]:
        """Lent caches holding the first `n` tokens of `entry`; marks it recently used."""
        total = len(entry.tokens)
        caches = [lend_prefix(c, n, total) for c in entry.caches]
        entry.last_used_s = time.monotonic()
        self.entries.move_to_end(entry.key)
        return caches

    def lookup(self, prompt_ids: list[int], adapter: str | None = None) -> Lookup:
        """Longest reusable prefix of `prompt_ids`, leaving at least its last token to feed,
        made with the same adapter choice."""
        entry, n, reason, shared = self.find(prompt_ids, adapter)
        if entry is None:
            return self._miss(reason, shared)
        self.metrics.cache_hits.labels(self.tier).inc()
        self.metrics.cache_hit_tokens.labels(self.tier).inc(n)
        log.debug("prompt cache hit: %d of %d prompt tokens", n, len(prompt_ids))
        return Lookup(self.take(entry, n), n, "hit")

    def _miss(self, reason: str, shared: int) -> Lookup:
        self.metrics.cache_misses.labels(reason).inc()
        log.debug("prompt cache miss (%s): %d tokens shared with an entry", reason, shared)
        return Lookup(None, 0, reason)

    def put(self, tokens: list[int], caches: list[Any], adapter: str | None = None,
            handed: bool = False) -> Entry | None:
        """Keep a copy of `caches` (holding exactly `tokens`, computed with the adapter
        choice `adapter`) for reuse (see `own`; `handed`: their buffers are given, not
        copied)."""
        if self.max_bytes <= 0 or not tokens:
            return None
        return self.put_model(tokens, caches, model_key(adapter), handed)

    def put_model(self, tokens: list[int], caches: list[Any], model: str,
                  handed: bool = False) -> Entry | None:
        if self.max_bytes <= 0 or not tokens:
            return None
        block = next((c.block for c in caches if isinstance(c, SharedKVCache)), None)
        if block is not None and not (handed and all(
                isinstance(c, SharedKVCache) and c.block is block for c in caches)):
            block, handed = None, False   # not handed whole: every layer copied out of it
            caches = [_plain(c) if isinstance(c, SharedKVCache) else c for c in caches]
        pending: list[mx.array] = []
        owned = [own(c, pending, handed) for c in caches]
        entry = Entry(tuple(tokens), [c for c, _ in owned], sum(n for _, n in owned),
                      can_trim_prompt_cache(caches), model=model, block=block)
        if entry.nbytes > self.max_bytes:   # known from the shapes: the copies never run
            self._too_large(entry)
            if block is not None:   # the block's gathers still run: its other rows' views
                self._device(pending)   # would otherwise hold the whole batch they read
            return None
        self._device(pending)
        key = entry.key
        prev = self.entries.pop(key, None)
        if prev is not None:
            self._discharge(prev)
        self._searched = None
        # the trie keys the entry by its own tuple (shared, not copied); one walk over it
        # adds it and, when it is trimmable, drops the shorter entries it extends
        gone: list[tuple[int, Entry]] = []
        if entry.trimmable:
            gone = self.trie.add_over_prefixes(model, entry.tokens, entry)[1]
        else:
            self.trie.add(model, entry.tokens, entry)
        self.entries[key] = entry
        self._charge(entry)
        for n, old in gone:   # redundant now: the new entry serves every prefix of it
            if old is not entry and self.entries.pop(old.key, None) is not None:
                self._discharge(old)
        self._evict()
        self._report()
        return entry if key in self.entries else None

    def _device(self, pending: list[mx.array]) -> None:
        if not pending:
            return
        if self._batch is not None:   # inside `batch()`: one device call for all the puts
            self._batch.extend(pending)
        else:
            mx.async_eval(pending)   # the copies run on the device; nothing waits for them

    def _charge(self, entry: Entry) -> None:
        """An entry comes in: its bytes, or its block's the first time one of the block's
        entries does (a block is held whole while any of its views is)."""
        block = entry.block
        if block is None:
            self.nbytes += entry.nbytes
            return
        live = self._blocks.setdefault(id(block), _Live(block))
        if live.leaving:
            self.nbytes += entry.nbytes
        elif not live.entries:
            self.nbytes += block.nbytes
        live.entries[entry.key] = entry

    def _discharge(self, entry: Entry) -> None:
        """An entry goes: its bytes, or, for one in a block, the block's once its last entry
        went. When what is left of a block uses less than half of it, the entries left are
        copied out of it (once each), so it is freed: a hit entry that outlives the others
        of its burst never keeps all of them alive."""
        block = entry.block
        if block is None:
            self.nbytes -= entry.nbytes
            return
        live = self._blocks.get(id(block))
        if live is None or live.entries.pop(entry.key, None) is None:
            return
        if live.leaving:   # counted by its entries' own bytes already
            self.nbytes -= entry.nbytes
            if not live.entries:
                del self._blocks[id(block)]
            return
        if not live.entries:
            del self._blocks[id(block)]
            self.nbytes -= block.nbytes
            return
        if 2 * sum(e.nbytes for e in live.entries.values()) >= block.nbytes:
            return
        # counted from now on as if its entries were copied out; inside `batch()` the copies
        # wait for its end: rows finishing together each replace their prompt's entry, and
        # copying a block's survivors out at the half mark copied entries about to go too
        live.leaving = True
        self.nbytes += sum(e.nbytes for e in live.entries.values()) - block.nbytes
        if self._batch is None:
            self._copy_out(live)

    def _copy_out(self, live: _Live) -> None:
        """A leaving block's entries, each copied to its own arrays: the block is freed."""
        del self._blocks[id(live.block)]
        pending: list[mx.array] = []
        for left in live.entries.values():
            owned = [own(c, pending) for c in left.caches]
            left.caches, left.block = [c for c, _ in owned], None
            nbytes = sum(n for _, n in owned)
            self.nbytes += nbytes - left.nbytes
            left.nbytes = nbytes
        self._device(pending)
        log.debug("prompt cache: %d entries copied out of a block they alone held",
                  len(live.entries))

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(entry.key, None) is not None:
            self._searched = None
            self.trie.pop(entry.model, entry.tokens)
            self._discharge(entry)
            self._report()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Puts made inside go to the device in one call when it ends, after the evictions
        they caused (so no copy is made while what they evict is still held). Each call gives
        the GIL up, and an event loop busy beside the engine thread may keep it for a switch
        interval: 128 rows finishing together made 128. A tier that spills what it evicts
        (`on_evict`) reads the entries it evicts, so there each put goes to the device at once."""
        if self._batch is not None or self.on_evict is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            for live in [b for b in self._blocks.values() if b.leaving]:
                self._copy_out(live)   # their copies join the batch's device call
            batch, self._batch = self._batch, None
            if batch:
                mx.async_eval(batch)

    def _too_large(self, entry: Entry) -> None:
        self.metrics.cache_too_large.labels(self.tier).inc()
        if not self._warned_size:
            self._warned_size = True
            log.warning("prompt cache: a %d-token prefix takes %.2f GiB, more than the RAM tier "
                        "holds (%.2f GiB): not kept, so its repeat is computed again; raise "
                        "cache.ram_gb to keep it", len(entry.tokens), entry.nbytes / (1 << 30),
                        self.max_bytes / (1 << 30))

    def kept(self, sizes: list[int]) -> int:
        """Of new entries of these byte sizes put one after another (nothing looked up
        between), how many of the last ones this tier still holds after the last put: it
        evicts the least recently used first, every older entry before the first of them and
        the first of them before the last. A tier that spills what it evicts (`on_evict`:
        the SSD tier behind it) keeps all but those larger than the RAM tier, which it never
        takes. Pins are not counted: it may say a few more."""
        if self.on_evict is not None or self.max_bytes <= 0:   # one larger than the tier: never
            return sum(s <= self.max_bytes for s in sizes) if self.on_evict is not None else 0
        room, n = self.max_bytes, 0
        for size in reversed(sizes):
            if size > room:
                break
            room, n = room - size, n + 1
        return n

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self.entries:
            self.evict_oldest()

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry (spilling it to the SSD tier, if any); False
        when there is none. kv=paged calls it when its block pool runs short: cached
        prefixes and running rows share one pool, and running rows come first."""
        if not self.entries:
            return False
        entry = self._victim()
        del self.entries[entry.key]
        self._searched = None
        self.trie.pop(entry.model, entry.tokens)
        self._discharge(entry)
        self.metrics.cache_evictions.labels(self.tier).inc()
        self.ghosts.add(entry.tokens, entry.model, (entry.last_used_s, time.monotonic()))
        if self.on_evict is not None:
            self.on_evict(entry)
        self._report()
        return True

    def tick(self) -> None:
        """Engine idle: nothing to do in RAM."""

    def flush(self) -> threading.Event:
        """Nothing waits for a disk: already set."""
        done = threading.Event()
        done.set()
        return done

    def close(self) -> None:
        """Nothing to drain."""

    # -- pins (Anthropic cache_control breakpoints) -----------------------------------------
    def pin(self, tokens: list[int], ttl_s: float, adapter: str | None = None) -> None:
        """Keep the entry holding `tokens` (once there is one) out of eviction for `ttl_s`;
        a later pin of the same prefix refreshes it, as a cache hit refreshes Anthropic's."""
        if tokens:
            key = (model_key(adapter), tuple(tokens))
            self.pins[key] = max(self.pins.get(key, 0.0), time.monotonic() + ttl_s)
            if len(self.pins) > MAX_PINS:   # the one that would expire first goes
                del self.pins[min(self.pins, key=self.pins.__getitem__)]

    def _protected(self) -> set[tuple[str, tuple[int, ...]]]:
        """Keys of the entries holding an unexpired pin: the entry of exactly its tokens, or
        one that extends them (its prefix is the pinned one)."""
        now = time.monotonic()
        for key in [k for k, until in self.pins.items() if until <= now]:
            del self.pins[key]
        held = set()
        for model, tokens in self.pins:
            found = self.trie.search(model, list(tokens))
            holder = found.exact if found.exact is not None else found.longer
            if holder is not None:
                held.add((model, tuple(holder)))
        return held

    def _victim(self) -> Entry:
        """The least recently used entry no pin holds (the oldest of all when every one is
        pinned: the byte cap wins over a pin)."""
        if self.pins:
            held = self._protected()
            for key, entry in self.entries.items():
                if key not in held:
                    return entry
        return next(iter(self.entries.values()))

    def _report(self) -> None:
        self.metrics.cache_entries.labels(self.tier).set(len(self.entries))
        self.metrics.cache_bytes.labels(self.tier).set(self.nbytes)
