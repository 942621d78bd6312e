"""Rows that finish in the same step on a RAM-only prompt cache too small for all their
entries: only the entries the cache can hold are copied (the first would be evicted at once by
the last), and the cache then holds them; every answer is the cold one. With an SSD tier behind
the RAM tier every entry is kept (what the RAM tier evicts is written to disk). Real tiny
models, the engine alone; RamPromptCache.kept is the count."""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import mlx.core as mx
from prometheus_client import CollectorRegistry

from pipeserve.metrics import Metrics
from pipeserve.prompt_cache import ram as ram_module
from pipeserve.prompt_cache.ram import RamPromptCache
from tests.conftest import make_config

EOS_OFF = {0: -100.0, 2: -100.0}
ROWS, PROMPT, OUT = 8, 40, 4
ONE_GROUP = ("model=tiny", f"scheduler.max_batch={ROWS}", "scheduler.arrival_gap_ms=100",
             "scheduler.arrival_window_ms=2000")   # one group: every row finishes in one step


def burst(h, prompts: list[list[int]]) -> list[dict]:
    """Every prompt at once, OUT tokens each (EOS off: all finish in one step)."""
    return asyncio.run(h.generate_many(
        [h.request(p, max_tokens=OUT, logit_bias=EOS_OFF) for p in prompts]))


def test_the_cache_counts_what_it_would_keep_of_entries_put_in_a_row() -> None:
    cache = RamPromptCache(make_config("cache=ram"), Metrics(CollectorRegistry()))
    cache.max_bytes = 100
    assert cache.kept([30, 30, 30, 30]) == 3      # the first goes for the fourth
    assert cache.kept([30, 30, 80]) == 1          # the last alone fills it
    assert cache.kept([120]) == 0 and cache.kept([]) == 0
    cache.on_evict = lambda entry: None           # an SSD tier behind it keeps them all
    assert cache.kept([30, 30, 30, 30]) == 4


def test_rows_finishing_together_copy_only_what_the_cache_keeps(engine_factory,
                                                               monkeypatch) -> None:
    prompts = [[5 + (i * 7 + j) % 200 for j in range(PROMPT)] for i in range(ROWS)]
    cold = engine_factory(*ONE_GROUP, "cache=off")
    expected = burst(cold, prompts)
    cold.close()

    h = engine_factory(*ONE_GROUP)
    cache = h.engine.step._cache
    h.generate([7] * PROMPT, max_tokens=OUT, logit_bias=EOS_OFF)   # an entry's size, measured
    one = max(cache.entries.values(), key=lambda e: len(e.tokens))
    per_token = one.nbytes / len(one.tokens)
    cache.max_bytes = int(3.5 * per_token * (PROMPT + OUT))   # three finished rows' entries
    puts: list[int] = []
    calls: list[int] = []   # arrays in each device call the puts make (engine thread)
    inner, real_eval = cache.put, mx.async_eval

    def put(tokens, caches, adapter=None, handed=False):   # engine thread
        puts.append(len(tokens))
        return inner(tokens, caches, adapter, handed)

    def async_eval(*arrays):
        engine = threading.current_thread().name == "pipeserve-engine"
        if engine and getattr(cache, "_batch", None) is None \
                and any(n > PROMPT for n in puts):   # from the first finished put on
            calls.append(len(arrays[0]) if len(arrays) == 1 and isinstance(arrays[0], list)
                         else len(arrays))
        return real_eval(*arrays)
    cache.put = put
    monkeypatch.setattr(ram_module.mx, "async_eval", async_eval)
    got = burst(h, prompts)
    monkeypatch.undo()

    assert [g["ids"] for g in got] == [e["ids"] for e in expected]
    finished = [n for n in puts if n > PROMPT]   # prompt + output entries (prompts: < PROMPT)
    assert len(finished) == 3, puts
    # the three entries' copies went to the device together: one call, one gather of both
    # arrays of every layer for the three rows (not one copy a row and layer; and one call a
    # put before that: each gives the GIL up to a busy event loop)
    layers = len(one.caches)
    assert calls[:1] == [2 * layers], calls
    held = [e for e in cache.entries.values() if len(e.tokens) > PROMPT]
    assert len(held) == 3 and cache.nbytes <= cache.max_bytes
    # ... views of that one block, counted once
    assert held[0].block is not None and all(e.block is held[0].block for e in held)
    others = sum(e.nbytes for e in cache.entries.values() if e.block is None)
    assert cache.nbytes == others + held[0].block.nbytes


def test_next_turns_after_a_burst_hit_the_rows_block_and_answer_as_cold(engine_factory) -> None:
    """Rows finishing together are stored as views of one block; each one's next turn (its
    prompt, its answer and new tokens: an agent's loop) is a hit on it and answers what an
    engine without a cache answers."""
    prompts = [[5 + (i * 11 + j) % 200 for j in range(PROMPT)] for i in range(ROWS)]
    cold = engine_factory(*ONE_GROUP, "cache=off")
    first = burst(cold, prompts)
    turns = [p + f["ids"] + [40 + i, 41, 42] for i, (p, f) in enumerate(zip(prompts, first))]
    expected = burst(cold, turns)
    cold.close()

    h = engine_factory(*ONE_GROUP)
    got = burst(h, prompts)
    assert [g["ids"] for g in got] == [f["ids"] for f in first]
    cache = h.engine.step._cache
    held = [e for e in cache.entries.values() if len(e.tokens) > PROMPT]
    assert len(held) == ROWS and len({id(e.block) for e in held}) == 1 and held[0].block
    again = burst(h, turns)
    assert [a["ids"] for a in again] == [e["ids"] for e in expected]
    assert all(a["cached"] >= PROMPT + OUT - 1 for a in again), [a["cached"] for a in again]


def test_prefixes_shorter_than_any_hit_a_lookup_takes_are_not_stored(engine_factory) -> None:
    """With cache.min_reuse_tokens (256 on a GPU unless set) a lookup never takes a shorter
    hit, so a prompt or a finished row shorter than that is not copied into the cache at all
    (a burst of 128 short chats stores nothing); longer ones are, and are reused."""
    h = engine_factory("model=tiny", "cache.min_reuse_tokens=64")
    cache = h.engine.step._cache
    short = [5 + j % 50 for j in range(40)]
    h.generate(short, max_tokens=OUT, logit_bias=EOS_OFF)   # 40 + 4 tokens: nothing kept
    assert not cache.entries and cache.nbytes == 0
    long = [7 + j % 90 for j in range(100)]
    first = h.generate(long, max_tokens=OUT, logit_bias=EOS_OFF)
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [100 + OUT - 1]
    again = h.generate(long, max_tokens=OUT, logit_bias=EOS_OFF)
    assert again["ids"] == first["ids"] and again["cached"] == 99


def test_prompt_copies_of_rows_decoding_together_share_one_gather(engine_factory) -> None:
    """The prompt copies a pass makes between steps (up to 8 rows whose first token is out)
    come from one gather a layer for the rows of one batch: the entries are views of a shared
    block, each exactly its prompt. Read while the rows still decode (their finish would
    replace them)."""
    from pipeserve.core.events import Settle, TokenDelta
    from pipeserve.core.stream import RequestStream
    prompts = [[5 + (i * 11 + j) % 200 for j in range(PROMPT)] for i in range(ROWS)]
    h = engine_factory(*ONE_GROUP)

    async def run() -> list:
        loop = asyncio.get_running_loop()
        reqs = [h.request(p, max_tokens=4000, logit_bias=EOS_OFF) for p in prompts]
        streams = [RequestStream(loop) for _ in reqs]
        for r, s in zip(reqs, streams):
            h.engine.submit(r, s)
        for s in streams:   # every row has tokens out: the pass after their first copied them
            seen = 0
            while seen < 3:
                event = await s.next()
                assert isinstance(event, TokenDelta), event
                seen += len(event.token_ids)
        await asyncio.wrap_future(h.engine.command(Settle()))
        cache = h.engine.step._cache
        held = [e for e in list(cache.entries.values()) if len(e.tokens) == PROMPT - 1]
        for r in reqs:
            h.engine.abort(r.request_id)
        return held
    held = asyncio.run(run())
    assert sorted(e.tokens for e in held) == sorted(tuple(p[:PROMPT - 1]) for p in prompts)
    # one block a batch the rows sat in (the decode batch, a prefill group not merged yet);
    # copied row by row, no entry would be in a block
    shared = Counter(id(e.block) for e in held if e.block is not None)
    assert shared and max(shared.values()) >= ROWS // 2, shared
    assert all(c.offset == c.keys.shape[2] == PROMPT - 1 for e in held for c in e.caches)
