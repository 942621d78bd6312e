"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of a
row's trailing n-gram. Pure Python, one index per request; engine thread."""
from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """Token history of one row (prompt + output) and, for every n in [n_min, n_max], the
    latest position each n-gram was followed by a token.

    `extend` costs O(n_max - n_min + 1) per token; `propose` costs O(n_max + k). An n-gram is
    indexed only once a token follows it, so the lookup of the trailing n-gram always finds an
    earlier occurrence, never the trailing one itself."""

    def __init__(self, n_min: int = 1, n_max: int = 3) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got n_min={n_min} n_max={n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.token_ids: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens (the prompt once, then each step's emitted tokens)."""
        toks = self.token_ids
        for tok in token_ids:
            end = len(toks)  # the n-grams ending here are now followed by `tok`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._next[tuple(toks[end - n:end])] = end
            toks.append(int(tok))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest trailing
        n-gram (n from n_max down to n_min) that occurred before; [] when none did or k <= 0."""
        toks = self.token_ids
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            start = self._next.get(tuple(toks[len(toks) - n:]))
            if start is not None:
                return toks[start:start + k]
        return []
