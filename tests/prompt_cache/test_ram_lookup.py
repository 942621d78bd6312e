"""RamPromptCache's lookup and the explanation of a partial hit, on real KV caches: an exact
repeat reuses all but its last token, a new turn reuses the longest shared prefix, and the
explanation (which reuses the lookup's trie search) follows every put and removal."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry

from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.explain import explain
from pipeserve.prompt_cache.ram import RamPromptCache
from tests.conftest import make_config

HEAD = [40 + (i * 13) % 300 for i in range(100)]


def kv(n: int) -> list[KVCache]:
    c = KVCache()
    k = mx.random.normal((1, 2, n, 4))
    c.update_and_fetch(k, k + 1)
    return [c]


def decode(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_repeat_new_turn_and_their_explanations_follow_the_entries() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    a = HEAD + [1, 2, 3]
    cache.put(a, kv(len(a)))
    repeat = cache.lookup(a + [7])   # a's prompt again: all but the fed last token
    assert repeat.reason == "hit" and repeat.num_tokens == len(a)
    assert explain(cache, a + [7], None, repeat.num_tokens, decode) is None

    turn = HEAD + [9, 9, 9, 9, 9]
    hit = cache.lookup(turn)
    assert hit.num_tokens == len(HEAD) and hit.caches[0].offset == len(HEAD)
    why = explain(cache, turn, None, hit.num_tokens, decode)
    assert why["reason"] == "diverged_at" and why["index"] == len(HEAD)
    assert why["cached_span"] == "1,2,3"

    b = HEAD + [9, 9, 9, 5, 5]   # a longer entry now shares more of the turn
    cache.put(b, kv(len(b)))
    hit = cache.lookup(turn)
    assert hit.num_tokens == len(HEAD) + 3
    why = explain(cache, turn, None, hit.num_tokens, decode)
    assert why["index"] == len(HEAD) + 3 and why["cached_span"] == "5,5"

    cache.remove(cache.entries[("model", tuple(b))])
    hit = cache.lookup(turn)
    assert hit.num_tokens == len(HEAD)
    assert explain(cache, turn, None, hit.num_tokens, decode)["index"] == len(HEAD)
