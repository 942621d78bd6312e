"""TokenTrie answers what mlx-lm's PromptTrie answers (exact, longest stored prefix, common
prefix, whether a stored sequence goes on past the match) under random adds, pops and
pop_prefixes; its `longer` is a stored sequence sharing the matched tokens (any one)."""
from __future__ import annotations

import random

import pytest
from mlx_lm.models.cache import PromptTrie

from pipeserve.prompt_cache.trie import TokenTrie


@pytest.mark.parametrize("seed", range(40))
def test_answers_as_mlx_lm_does_under_random_edits(seed: int) -> None:
    rng = random.Random(seed)
    ref, trie, stored = PromptTrie(), TokenTrie(), set()
    for _ in range(80):
        seq = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 7)))
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
        query = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        want, got = ref.search("m", query), trie.search("m", query)
        assert (got.exact, got.shorter, got.common_prefix) == (
            want.exact, want.shorter, want.common_prefix), query
        assert (got.longer is None) == (want.longer is None), query
        if got.longer is not None:
            assert tuple(got.longer) in stored
            assert got.longer[:got.common_prefix] == query[:got.common_prefix]
        for seq in stored:
            assert trie.get("m", list(seq)) == seq


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
