"""TokenTrie: token sequences (prompt cache keys) under a root per model, searched for the
longest stored prefix of a query and for a stored sequence that extends the query's matched
part. mlx-lm's PromptTrie answers the same questions, but finds the extending sequence by
walking the subtree below the match, copying the path at every node: quadratic in a long
entry's length, seconds for a 16k-token entry, on every lookup that shares a token with it.
Here every node keeps one stored sequence reachable below it, so a search costs the length of
the query.

A radix tree: a node's edge holds every token up to the next branch or stored sequence, so
the nodes are about two a stored sequence, not one a token. A dict a token made each 16k-token
entry 16k objects for Python's cyclic collector to walk, so its full collections (which hold
the GIL) grew with what the cache held. Not thread-safe: each owner calls it from one thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import PromptTrieResult

_EMPTY = object()   # a node that stores no sequence


class _Node:
    __slots__ = ("edge", "children", "value", "below")

    def __init__(self, edge: tuple[int, ...], below: tuple[int, ...] | None) -> None:
        self.edge = edge   # the tokens from its parent to it
        self.children: dict[int, _Node] = {}   # by the first token of the child's edge
        self.value: Any = _EMPTY
        # the key of one sequence stored at or below it (its own when it stores one); the
        # tokens inside its edge see the same ones. One key object per stored sequence: the
        # pointers to it are compared by identity (comparing 16k-token tuples would cost that)
        self.below = below


def _common(edge: tuple[int, ...], tokens: tuple[int, ...], at: int) -> int:
    """How many leading tokens of `edge` equal tokens[at:]: slices compared in C, the first
    difference found by halving."""
    n = min(len(edge), len(tokens) - at)
    if tokens[at:at + n] == edge[:n]:
        return n
    lo, hi = 0, n   # tokens[at:at + lo] matches; within lo:hi is a difference
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens[at + lo:at + mid] == edge[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenTrie:
    def __init__(self) -> None:
        self._roots: dict[Any, _Node] = {}

    def add(self, model: Any, tokens: Sequence[int], value: Any) -> Any:
        """Store `value` under `tokens`; returns the value it replaced, if any."""
        return self._add(model, tokens, value)[0]

    def add_over_prefixes(self, model: Any, tokens: Sequence[int],
                          value: Any) -> tuple[Any, list[tuple[int, Any]]]:
        """`add`, then `pop_prefixes` of the same tokens, walking them once: (the value it
        replaced, the (length, value) of every stored proper prefix it removed)."""
        prev, path = self._add(model, tokens, value)
        return prev, self._pop_prefixes(path, len(tokens))

    def _add(self, model: Any, tokens: Sequence[int], value: Any) -> tuple[Any, list[_Node]]:
        t = tuple(tokens)
        node = self._roots.get(model)
        if node is None:
            node = self._roots[model] = _Node((), None)
        path, at = [node], 0
        while at < len(t):
            child = node.children.get(t[at])
            if child is None:   # the rest of the tokens: one new edge
                child = node.children[t[at]] = _Node(t[at:], None)
                at = len(t)
            else:
                k = _common(child.edge, t, at)
                if k < len(child.edge):   # the tokens leave (or end inside) its edge: split
                    mid = _Node(child.edge[:k], child.below)
                    child.edge = child.edge[k:]
                    mid.children[child.edge[0]] = child
                    child = node.children[t[at]] = mid
                at += k
            path.append(child)
            node = child
        key = node.below if node.value is not _EMPTY else t
        for n in path:   # a root emptied before points at None: it points at this now
            if n.below is None:
                n.below = key
        prev = None if node.value is _EMPTY else node.value
        node.value, node.below = value, key
        return prev, path

    def models(self) -> list[Any]:
        """The roots that hold a sequence (a few: one per adapter choice), without a walk
        over the stored entries."""
        return [m for m, node in self._roots.items() if node.below is not None]

    def get(self, model: Any, tokens: list[int]) -> Any:
        value = self._path(model, tokens)[-1].value
        if value is _EMPTY:
            raise KeyError(tuple(tokens))
        return value

    def _path(self, model: Any, tokens: Sequence[int]) -> list[_Node]:
        """The nodes from the root to the one that ends at `tokens` (KeyError: none does)."""
        t = tuple(tokens)
        node = self._roots[model]
        path, at = [node], 0
        while at < len(t):
            node = node.children[t[at]]
            end = at + len(node.edge)
            if t[at:end] != node.edge:
                raise KeyError(t)
            path.append(node)
            at = end
        return path

    def pop(self, model: Any, tokens: list[int]) -> Any:
        """Remove the value stored under `tokens` (KeyError when there is none)."""
        path = self._path(model, tokens)
        end = path[-1]
        if end.value is _EMPTY:
            raise KeyError(tuple(tokens))
        value, end.value = end.value, _EMPTY
        gone = {id(end.below)}
        while len(path) > 1 and not path[-1].children and path[-1].value is _EMPTY:
            dead = path.pop()   # a branch nothing else uses
            del path[-1].children[dead.edge[0]]
        _repair(path, gone)
        _merge(path, len(path) - 1)
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        """Remove and return (length, value) of every stored proper prefix of `tokens`."""
        return self._pop_prefixes(self._path(model, tokens), len(tokens))

    @staticmethod
    def _pop_prefixes(path: list[_Node], n: int) -> list[tuple[int, Any]]:
        values, gone, emptied, depth = [], set(), [], 0
        for i, node in enumerate(path):
            depth += len(node.edge)
            if depth < n and node.value is not _EMPTY:
                values.append((depth, node.value))
                gone.add(id(node.below))
                node.value = _EMPTY
                emptied.append(i)
        if gone:
            _repair(path, gone)
            for i in reversed(emptied):   # deepest first: a merge leaves the indices above
                _merge(path, i)
        return values

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        """exact: `tokens` itself is stored; shorter: the longest stored proper prefix;
        longer: a stored sequence sharing all `common_prefix` matched tokens and going on
        past them (any one, not necessarily the shortest); common_prefix: how many leading
        tokens some stored sequence shares with `tokens`."""
        node = self._roots.get(model)
        if node is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and node.value is not _EMPTY:
            return PromptTrieResult(model, [], None, None, 0)
        t = tuple(tokens)
        last, index, at = -1, 0, node   # `at`: the node whose edge holds the match's end
        while index < len(t):   # an edge compared at once: this walk is a hit's cost on the host
            child = node.children.get(t[index])
            if child is None:
                break
            k = _common(child.edge, t, index)
            index += k
            at = child
            if k < len(child.edge):
                break
            node = child
            if node.value is not _EMPTY:
                last = index - 1
        if last == len(t) - 1 >= 0:
            return PromptTrieResult(model, list(t), None, None, 0)
        shorter = list(t[:last + 1]) if last > 0 else None
        longer = None
        if index > 0 and at.below is not None:
            longer = list(at.below)
        return PromptTrieResult(model, None, shorter, longer, index)


def _pick(node: _Node, gone: set[int]) -> tuple[int, ...] | None:
    """A stored sequence below `node` (from a child's pointer), none of `gone` (by id)."""
    for child in node.children.values():
        if child.below is not None and id(child.below) not in gone:
            return child.below
    return None


def _repair(path: list[_Node], gone: set[int]) -> None:
    """After the sequences `gone` (ids of their key objects) left the trie: the nodes on
    their path that pointed at one point at another sequence below them (deepest first, so
    each parent can take a child's). A node holding a value points at its own sequence."""
    for node in reversed(path):
        if id(node.below) in gone:
            node.below = _pick(node, gone)


def _merge(path: list[_Node], i: int) -> None:
    """path[i], stored nothing now and with one child, joins that child's edge (not a root)."""
    node = path[i]
    if i == 0 or node.value is not _EMPTY or len(node.children) != 1:
        return
    (child,) = node.children.values()
    child.edge = node.edge + child.edge
    path[i - 1].children[node.edge[0]] = child
    if i + 1 < len(path) and path[i + 1] is child:
        del path[i]
    else:
        path[i] = child
