"""TokenTrie: token sequences (prompt cache keys) under a root per model, searched for the
longest stored prefix of a query and for a stored sequence that extends the query's matched
part. mlx-lm's PromptTrie answers the same questions, but finds the extending sequence by
walking the subtree below the match, copying the path at every node: quadratic in a long
entry's length, seconds for a 16k-token entry, on every lookup that shares a token with it.
Here every node keeps one stored sequence reachable below it, so a search costs the length of
the query. Not thread-safe: each owner calls it from one thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import PromptTrieResult

VALUE = "__value__"   # the value stored at a node (a sequence ends there)
BELOW = "__below__"   # the tokens of one stored sequence at or below this node


class TokenTrie:
    def __init__(self) -> None:
        self._roots: dict[Any, dict] = {}

    def add(self, model: Any, tokens: Sequence[int], value: Any) -> Any:
        """Store `value` under `tokens`; returns the value it replaced, if any."""
        return self._add(model, tokens, value)[0]

    def add_over_prefixes(self, model: Any, tokens: Sequence[int],
                          value: Any) -> tuple[Any, list[tuple[int, Any]]]:
        """`add`, then `pop_prefixes` of the same tokens, walking them once: (the value it
        replaced, the (length, value) of every stored proper prefix it removed)."""
        prev, path = self._add(model, tokens, value)
        return prev, self._pop_prefixes(path, len(tokens))

    def _add(self, model: Any, tokens: Sequence[int], value: Any) -> tuple[Any, list[dict]]:
        node = self._roots.setdefault(model, {})
        path = [node]
        for tok in tokens:   # no new dict made for a node that is there (setdefault would)
            child = node.get(tok)
            if child is None:
                child = node[tok] = {}
            path.append(child)
            node = child
        end = path[-1]
        # one key object per stored sequence: the pointers to it are compared by identity
        # (hashing or comparing a 16k-token tuple at every node would cost its length)
        key = end[BELOW] if VALUE in end else tuple(tokens)
        for node in path:   # a root emptied before points at None: it points at this now
            if node.get(BELOW) is None:
                node[BELOW] = key
        prev = end.get(VALUE)
        end[VALUE] = value
        end[BELOW] = key
        return prev, path

    def models(self) -> list[Any]:
        """The roots that hold a sequence (a few: one per adapter choice), without a walk
        over the stored entries."""
        return [m for m, node in self._roots.items() if node.get(BELOW) is not None]

    def get(self, model: Any, tokens: list[int]) -> Any:
        node = self._roots[model]
        for tok in tokens:
            node = node[tok]
        return node[VALUE]

    def _path(self, model: Any, tokens: list[int]) -> list[dict]:
        path = [self._roots[model]]
        for tok in tokens:
            path.append(path[-1][tok])
        return path

    def pop(self, model: Any, tokens: list[int]) -> Any:
        """Remove the value stored under `tokens` (KeyError when there is none)."""
        path = self._path(model, tokens)
        value = path[-1].pop(VALUE)
        gone = {id(path[-1][BELOW])}
        for i in range(len(tokens), 0, -1):   # drop the branch nodes nothing else uses
            if _children(path[i]) or VALUE in path[i]:
                break
            del path[i - 1][tokens[i - 1]]
            path.pop()
        _repair(path, gone)
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        """Remove and return (length, value) of every stored proper prefix of `tokens`."""
        return self._pop_prefixes(self._path(model, tokens), len(tokens))

    @staticmethod
    def _pop_prefixes(path: list[dict], n: int) -> list[tuple[int, Any]]:
        popped = [i for i in range(n) if VALUE in path[i]]
        gone = {id(path[i][BELOW]) for i in popped}
        values = [(i, path[i].pop(VALUE)) for i in popped]
        if gone:
            _repair(path, gone)
        return values

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        """exact: `tokens` itself is stored; shorter: the longest stored proper prefix;
        longer: a stored sequence sharing all `common_prefix` matched tokens and going on
        past them (any one, not necessarily the shortest); common_prefix: how many leading
        tokens some stored sequence shares with `tokens`."""
        node = self._roots.get(model)
        if node is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and VALUE in node:
            return PromptTrieResult(model, [], None, None, 0)
        last, index = -1, 0
        for tok in tokens:   # one dict probe a token: this walk is a hit's cost on the host
            child = node.get(tok)
            if child is None:
                break
            node = child
            if VALUE in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, list(tokens), None, None, 0)
        shorter = list(tokens[:last + 1]) if last > 0 else None
        longer = None
        if index > 0:
            below = node.get(BELOW)
            longer = list(below) if below is not None else None
        return PromptTrieResult(model, None, shorter, longer, index)


def _children(node: dict) -> list[dict]:
    return [v for k, v in node.items() if k not in (VALUE, BELOW)]


def _pick(node: dict, gone: set[int]) -> tuple[int, ...] | None:
    """A stored sequence below `node` (from a child's pointer), none of `gone` (by id)."""
    for child in _children(node):
        below = child.get(BELOW)
        if below is not None and id(below) not in gone:
            return below
    return None


def _repair(path: list[dict], gone: set[int]) -> None:
    """After the sequences `gone` (ids of their key objects) left the trie: the nodes on
    their path that pointed at one point at another sequence below them (deepest first, so
    each parent can take a child's). A node holding a value points at its own sequence."""
    for node in reversed(path):
        if id(node.get(BELOW)) in gone:
            node[BELOW] = _pick(node, gone)
