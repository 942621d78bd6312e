"""A burst of requests that share a cached head, prefilled as one group (the engine alone on
real tiny models): every row's greedy output equals the same prompt served with no cache, and
the engine's peak memory over the burst (MLX's own counter), less what the prompt cache keeps
of it, stays under twice the rows' own KV: the group's buffer (the rows, with room for their
chunk up to the next 256-token step) and, as rows finish, their copies on the way to the cache
are all it should hold at once."""
from __future__ import annotations

import asyncio

import mlx.core as mx

EOS_OFF = {0: -100.0, 2: -100.0}
HEAD = [40 + (i * 13) % 300 for i in range(1000)]    # the shared head, already cached
ROWS = 8
OWN = 4       # each row's own tokens after the head
OUT = 4


def test_a_burst_of_hits_equals_cold_within_twice_its_kv(engine_factory) -> None:
    prompts = [HEAD + [5 + (i * 7 + j) % 200 for j in range(OWN)] for i in range(ROWS)]
    model = ("model=tiny", f"scheduler.max_batch={ROWS}", "scheduler.arrival_gap_ms=100",
             "scheduler.arrival_window_ms=2000")   # the burst as one prefill group
    cold = engine_factory(*model, "cache=off")
    expected = asyncio.run(cold.generate_many(
        [cold.request(p, max_tokens=OUT, logit_bias=EOS_OFF) for p in prompts]))
    cold.close()

    h = engine_factory(*model)
    h.generate(HEAD + [9, 9, 9], max_tokens=2, logit_bias=EOS_OFF)   # the head's entry
    cache = h.engine.step._cache
    mx.synchronize()
    held, base = cache.nbytes, mx.get_active_memory()
    mx.reset_peak_memory()
    got = asyncio.run(h.generate_many(
        [h.request(p, max_tokens=OUT, logit_bias=EOS_OFF) for p in prompts]))
    mx.synchronize()
    peak = mx.get_peak_memory() - base - (cache.nbytes - held)   # the cache's own copies out

    assert [g["ids"] for g in got] == [e["ids"] for e in expected]
    assert all(g["cached"] == len(HEAD) for g in got)
    rows_kv = ROWS * (len(HEAD) + OWN + OUT) * h.engine.memory.kv_bytes_per_token
    assert peak < 2.0 * rows_kv, f"the burst peaked at {peak / rows_kv:.2f}x its rows' KV"
