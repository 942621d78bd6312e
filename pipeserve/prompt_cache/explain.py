"""Why a prompt re-prefilled: the explanation of a lookup that reused less than the whole
prompt, for `usage.prompt_tokens_details.cache_miss_reason` and a counter by reason.
Engine thread (cache_lookup calls it at admission, on misses and partial hits only)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipeserve.prompt_cache.keys import model_key
from pipeserve.prompt_cache.ram import MIN_EXPLAINED, RamPromptCache

# cold: nothing cached shares the prompt; evicted: an entry that did was evicted (its age);
# diverged_at: the prompt leaves the longest cached entry at this token (the spans around it);
# no_snapshot: entries share more, but recurrent/sliding layers reuse only stored boundaries;
# adapter: an entry made under another adapter shares more; kv_scheme / incompatible: only an
# SSD entry of another KV scheme (or model, MLX, device) shares more; too_short: a prompt of
# one token leaves nothing to reuse (its last token is always computed).
REASONS = ("cold", "evicted", "diverged_at", "no_snapshot", "adapter", "kv_scheme",
           "incompatible", "too_short")
SPAN_TOKENS = 12   # tokens of text shown each side of a divergence


def explain(cache: Any, prompt_ids: list[int], adapter: str | None, reused: int,
            decode: Callable[[list[int]], str]) -> dict[str, Any] | None:
    """None when `reused` covers the prompt (all but the last token); else {"reason", ...}."""
    limit = len(prompt_ids) - 1
    if limit < 1:   # cached_tokens is 0 whatever the cache holds
        return {"reason": "too_short", "prompt_tokens": len(prompt_ids), "min_tokens": 2}
    if reused >= limit:
        return None
    ram: RamPromptCache = getattr(cache, "ram", cache)
    model, query = model_key(adapter), list(prompt_ids[:limit])
    shared, other = _longest(ram, model, query)
    floor = max(shared, reused, MIN_EXPLAINED - 1)
    ghost_n, note = ram.ghosts.match(query, model)
    if ghost_n > floor and note is not None:
        last_used_s, evicted_s = note
        now = time.monotonic()
        return {"reason": "evicted", "shared_tokens": ghost_n,
                "age_s": round(now - last_used_s, 3), "evicted_s_ago": round(now - evicted_s, 3)}
    other_n, root = _other_adapters(ram, model, query)
    if other_n > floor:
        return {"reason": "adapter", "shared_tokens": other_n,
                "entry_adapter": None if root == "model" else root.split(":", 1)[1],
                "adapter": adapter}
    foreign = _foreign(cache, model, query, floor)
    if foreign is not None:
        return foreign
    if shared > reused:
        return {"reason": "no_snapshot", "shared_tokens": shared, "reused_tokens": reused}
    if shared >= MIN_EXPLAINED and other is not None:
        at = shared
        return {"reason": "diverged_at", "index": at,
                "context": decode(query[max(0, at - SPAN_TOKENS):at]),
                "prompt_span": decode(list(prompt_ids[at:at + SPAN_TOKENS])),
                "cached_span": decode(list(other[at:at + SPAN_TOKENS]))}
    return {"reason": "cold"}


def _longest(ram: RamPromptCache, model: str,
             query: list[int]) -> tuple[int, tuple[int, ...] | None]:
    """(tokens of `query` the best entry of this adapter shares, that entry's tokens)."""
    if not ram.entries:
        return 0, None
    found = ram.search(model, query)   # the lookup's own search, not a second walk
    if found.exact is not None:
        return len(query), tuple(found.exact)
    best: tuple[int, tuple[int, ...] | None] = (0, None)
    if found.shorter:
        best = (len(found.shorter), tuple(found.shorter))
    if found.longer is not None and found.common_prefix >= best[0]:
        best = (found.common_prefix, tuple(found.longer))
    return best


def _other_adapters(ram: RamPromptCache, model: str, query: list[int]) -> tuple[int, str]:
    """(tokens of `query` the best entry made under another adapter choice shares, its root)."""
    best = (0, "")
    for root in ram.trie.models():   # not a walk over every entry: this runs per lookup
        if root == model:
            continue
        n = _longest(ram, root, query)[0]
        if n > best[0]:
            best = (n, root)
    return best


def _foreign(cache: Any, model: str, query: list[int], floor: int) -> dict[str, Any] | None:
    """An SSD entry stored under another identity shares more: name the KV scheme it was
    made with when that is the difference (the namespace's identity note), else incompatible."""
    ssd = getattr(cache, "ssd", None)
    if ssd is None:
        return None
    n, namespace = ssd.foreign.match(query, model)
    if n <= floor:
        return None
    theirs = ssd.namespace_note(namespace) if namespace else {}
    ours = ssd.namespace_note(ssd.dir.name)
    if theirs.get("kv") and theirs.get("kv") != ours.get("kv"):
        return {"reason": "kv_scheme", "shared_tokens": n, "entry_kv_scheme": theirs["kv"],
                "kv_scheme": ours.get("kv")}
    return {"reason": "incompatible", "shared_tokens": n,
            "differs": "model weights, dtype, MLX version, device, tokenizer or adapters"}
