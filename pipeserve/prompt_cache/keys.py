"""The token keys both tiers share: the trie root of a request's adapter choice, and the
ghost index (keys without KV) that explains misses. Engine thread only."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pipeserve.prompt_cache.trie import TokenTrie

TRIE_KEY = "model"   # the trie root of requests on the launch default (Request.adapter None)


def model_key(adapter: str | None) -> str:
    """The trie root (TokenTrie's model key) of a request's adapter choice
    (Request.adapter): entries never serve a request of another adapter."""
    return TRIE_KEY if adapter is None else "adapter:" + adapter


class GhostIndex:
    """Token keys only (no KV) of up to `limit` entries, to explain misses; each with a note
    (for evicted entries: when it was last used and when it was evicted)."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self.trie = TokenTrie()
        self.keys: OrderedDict[tuple[str, tuple[int, ...]], Any] = OrderedDict()

    def add(self, tokens: tuple[int, ...], model: str = TRIE_KEY, note: Any = None) -> None:
        if (model, tokens) in self.keys:
            self.keys[(model, tokens)] = note
            return
        self.keys[(model, tokens)] = note
        self.trie.add(model, list(tokens), True)
        while len(self.keys) > self.limit:
            (m, old), _ = self.keys.popitem(last=False)
            self.trie.pop(m, list(old))

    def shared(self, query: list[int], model: str = TRIE_KEY) -> int:
        """How many leading tokens of `query` some remembered key shares."""
        return self.match(query, model)[0]

    def match(self, query: list[int], model: str = TRIE_KEY) -> tuple[int, Any]:
        """(leading tokens of `query` the best remembered key shares, that key's note)."""
        if not self.keys:
            return 0, None
        found = self.trie.search(model, query)
        if found.exact is not None:
            return len(query), self.keys.get((model, tuple(found.exact)))
        best = (0, None)
        if found.shorter:
            best = (len(found.shorter), self.keys.get((model, tuple(found.shorter))))
        if found.longer is not None and found.common_prefix > best[0]:
            best = (found.common_prefix, self.keys.get((model, tuple(found.longer))))
        return best
