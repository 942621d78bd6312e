"""TokenTrie answers what mlx-lm's PromptTrie answers (exact, longest stored prefix, common
prefix, whether a stored sequence goes on past the match) under random adds, pops and
pop_prefixes; its `longer` is a stored sequence sharing the matched tokens (any one)."""
from __future__ import annotations

import random

import pytest
from mlx_lm.models.cache import PromptTrie

from pipeserve.prompt_cache.trie import TokenTrie


@pytest.mark.parametrize("seed", range(60))
def test_answers_as_mlx_lm_does_under_random_edits(seed: int) -> None:
    rng = random.Random(seed)
    ref, trie, stored = PromptTrie(), TokenTrie(), set()
    longest = 7 if seed < 40 else 14   # longer edges: splits and merges inside them
    for _ in range(80):
        seq = tuple(rng.randrange(4 if seed < 40 else 2) for _ in range(rng.randrange(1, longest)))
        r = rng.random()
        if r < 0.5 or (r < 0.75 and not stored):
            ref.add("m", list(seq), seq)
            assert trie.add("m", list(seq), seq) in (None, seq)
            stored.add(seq)
        elif r < 0.75:
            seq = rng.choice(sorted(stored))
            assert ref.pop("m", list(seq)) == trie.pop("m", list(seq)) == seq
            stored.discard(seq)
        else:   # the RAM cache's put: the longer entry replaces the prefixes it extends
            ref.add("m", list(seq), seq)
            stored.add(seq)
            popped = ref.pop_prefixes("m", list(seq))
            if rng.random() < 0.5:   # in two walks, or in one (the key given as a tuple)
                trie.add("m", list(seq), seq)
                assert trie.pop_prefixes("m", list(seq)) == popped
            else:
                assert trie.add_over_prefixes("m", seq, seq)[1] == popped
            stored -= {seq[:i] for i, _ in popped}
        query = [rng.randrange(4 if seed < 40 else 2) for _ in range(rng.randrange(0, longest + 1))]
        want, got = ref.search("m", query), trie.search("m", query)
        assert (got.exact, got.shorter, got.common_prefix) == (
            want.exact, want.shorter, want.common_prefix), query
        assert (got.longer is None) == (want.longer is None), query
        if got.longer is not None:
            assert tuple(got.longer) in stored
            assert got.longer[:got.common_prefix] == query[:got.common_prefix]
        for seq in stored:
            assert trie.get("m", list(seq)) == seq
        assert_compact(trie, stored)


def assert_compact(trie: TokenTrie, stored: set[tuple[int, ...]]) -> None:
    """The radix shape: no node but a root is empty with one child (it would have joined its
    child's edge), so there are at most two nodes a stored sequence; each node points at a
    sequence stored at or below it (its own when it stores one)."""
    from pipeserve.prompt_cache.trie import _EMPTY
    nodes = 0
    for root in trie._roots.values():
        todo = [(root, (), True)]
        while todo:
            node, prefix, is_root = todo.pop()
            nodes += 1
            here = prefix + node.edge
            if not is_root:
                assert node.value is not _EMPTY or len(node.children) != 1, here
                assert node.value is not _EMPTY or node.children, here
            if node.value is not _EMPTY:
                assert node.below == here and node.below in stored, here
            elif node.below is not None:
                assert node.below[:len(here)] == here and node.below in stored, here
            for first, child in node.children.items():
                assert child.edge[0] == first
                todo.append((child, here, False))
    assert nodes <= 2 * len(stored) + len(trie._roots)


def test_long_entries_extend_a_short_match() -> None:
    """A query sharing one token with 16k-token entries finds one of them as the sequence
    that goes on (the prompt cache then reuses that one token's KV from it); popping them one
    by one leaves the others findable, then none."""
    trie = TokenTrie()
    rng = random.Random(3)
    entries = [tuple([7] + [rng.randrange(500) for _ in range(16_000)]) for _ in range(3)]
    for e in entries:
        trie.add("m", list(e), e)
    left = list(entries)
    while left:
        found = trie.search("m", [7, 1, 2, 3])
        assert found.common_prefix == 1 and tuple(found.longer) in left
        trie.pop("m", list(found.longer))
        left.remove(tuple(found.longer))
    assert trie.search("m", [7, 1]).longer is None


def test_models_names_the_roots_that_hold_a_sequence() -> None:
    """What the miss explanation asks per lookup (entries under another adapter choice):
    a root whose last sequence left is no longer named."""
    t = TokenTrie()
    t.add("model", [1, 2, 3], "a")
    t.add("model:lora", [1, 2], "b")
    t.add("model:lora", [1, 2, 9], "c")
    assert sorted(t.models()) == ["model", "model:lora"]
    t.pop("model:lora", [1, 2])
    assert sorted(t.models()) == ["model", "model:lora"]
    t.pop("model:lora", [1, 2, 9])
    assert t.models() == ["model"]


def test_a_root_emptied_and_filled_again_is_listed_and_searched():
    """Every entry under a root removed, then a new one added: the root holds a sequence again
    (models() lists it, so a miss under another adapter can name this one) and a search that
    stops at the root's children still finds the longer entry."""
    t = TokenTrie()
    t.add("base", [1, 2, 3], "A")
    t.add("lora", [1, 2, 3], "L")
    t.pop("base", [1, 2, 3])
    assert t.models() == ["lora"]
    t.add("base", [5, 6, 7, 8], "B")
    assert sorted(t.models()) == ["base", "lora"]
    assert t.search("base", [5, 6, 7]).longer == [5, 6, 7, 8]
    assert t.search("base", [5, 9]).longer == [5, 6, 7, 8]


def test_a_long_entry_is_a_few_objects_for_the_collector() -> None:
    """Twenty 16k-token entries sharing a 2k head, then lookups and pops: the trie holds a
    few nodes an entry, not one a token, so Python's cyclic collector, whose full
    collections walk every live container while holding the GIL, does not grow with the
    tokens the prompt cache holds (it did: a dict a token)."""
    import gc

    from pipeserve.prompt_cache.trie import _Node
    rng = random.Random(5)
    head = [rng.randrange(500) for _ in range(2048)]
    entries = [tuple(head + [rng.randrange(500) for _ in range(14_000)]) for _ in range(20)]
    gc.collect()
    before = len(gc.get_objects())
    trie = TokenTrie()
    for e in entries:
        trie.add("m", e, e)
    gc.collect()
    grew = len(gc.get_objects()) - before
    nodes = sum(1 for o in gc.get_objects() if type(o) is _Node)
    assert nodes <= 2 * len(entries) + 1, nodes
    assert grew < 10 * len(entries), grew   # nodes and their child dicts: not 16k each
    found = trie.search("m", head + [entries[3][2048], 7, 7])
    assert found.common_prefix == 2049 and found.longer == list(entries[3])
    assert trie.search("m", list(entries[7]) + [1]).shorter == list(entries[7])
    for e in entries[:19]:
        trie.pop("m", list(e))
    assert trie.search("m", head[:10]).longer == list(entries[19])
    assert_compact(trie, {entries[19]})
