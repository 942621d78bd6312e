"""RAM prompt cache on real tiny models: a hit yields exactly the cold run's greedy tokens,
reports the reused tokens, leaves the donor intact, respects recurrent layers' exact
boundaries, works inside batches, and stays under its byte cap."""
from __future__ import annotations

import asyncio

import pytest

EOS_OFF = {0: -100.0, 2: -100.0}
SYSTEM = [40 + (i * 13) % 300 for i in range(120)]      # a shared "system prompt"


def cold(engine_factory, model: str, prompt: list[int], n: int = 16) -> list[int]:
    h = engine_factory(f"model={model}", "cache=off")
    return h.generate(prompt, max_tokens=n, logit_bias=EOS_OFF)["ids"]


@pytest.mark.parametrize("model", ["tiny", "llama", "gemma"])
def test_hit_equals_cold_and_the_donor_stays_intact(engine_factory, model: str) -> None:
    prompt = SYSTEM + [7, 8, 9]
    expected = cold(engine_factory, model, prompt)
    h = engine_factory(f"model={model}")
    first = h.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    second = h.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    third = h.generate(prompt, max_tokens=16, logit_bias=EOS_OFF)
    assert first["ids"] == second["ids"] == third["ids"] == expected
    assert first["cached"] == 0
    assert second["cached"] == third["cached"] == len(prompt) - 1   # the last token is fed


@pytest.mark.parametrize("model", ["tiny", "llama", "gemma"])
def test_shared_prefix_with_a_new_turn_reuses_the_prefix(engine_factory, model: str) -> None:
    """Attention-only models reuse any shared prefix (trimming the donor's view). Gemma's
    sliding-window layers (window 32 here) cannot rewind past their window, so a 120-token
    shared prefix of a longer entry is not reusable there: prefilled cold, explained."""
    a, b = SYSTEM + [5, 6, 7, 8], SYSTEM + [9, 10, 11]
    expected_b = cold(engine_factory, model, b)
    h = engine_factory(f"model={model}")
    h.generate(a, max_tokens=8, logit_bias=EOS_OFF)
    got = h.generate(b, max_tokens=16, logit_bias=EOS_OFF)
    assert got["ids"] == expected_b
    if model == "gemma":
        assert got["cached"] == 0
        assert h.metrics.cache_misses.labels("no_snapshot")._value.get() >= 1
    else:
        assert got["cached"] == len(SYSTEM)   # diverges right after the shared prefix


def test_hybrid_reuses_only_exact_boundaries(engine_factory) -> None:
    """qwen3_next's recurrent layers cannot be trimmed: a prompt that only shares part of a
    cached one is prefilled cold; one that extends a stored boundary reuses it."""
    a = SYSTEM + [5, 6, 7, 8]
    diverging = SYSTEM + [9, 10, 11]
    extending = a + [60, 61, 62]
    h = engine_factory("model=hybrid")
    h.generate(a, max_tokens=8, logit_bias=EOS_OFF)
    assert h.generate(diverging, max_tokens=4, logit_bias=EOS_OFF)["cached"] == 0
    got = h.generate(extending, max_tokens=16, logit_bias=EOS_OFF)
    assert got["cached"] in (len(a) - 1, len(a) + 8 - 1, len(a))   # a stored boundary
    assert got["cached"] > 0
    assert got["ids"] == cold(engine_factory, "hybrid", extending)
    misses = h.metrics.cache_misses.labels("no_snapshot")._value.get()
    assert misses >= 1


def test_concurrent_rows_sharing_a_prefix_are_exact(engine_factory) -> None:
    prompts = [SYSTEM + [100 + i, 101 + i] for i in range(5)]
    expected = [cold(engine_factory, "tiny", p) for p in prompts]
    h = engine_factory("scheduler=continuous")
    h.generate(SYSTEM + [3, 4], max_tokens=2, logit_bias=EOS_OFF)   # warm the shared prefix
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=16, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    assert all(g["cached"] >= len(SYSTEM) for g in got)


def test_byte_cap_evicts_least_recently_used(engine_factory) -> None:
    # tiny float32 KV: 512 B/token; an entry holds (and counts) only its tokens, not the
    # 256-token steps the row's buffer grew in: 51 prompt + 3 fed outputs = 27.6 kB per entry
    h = engine_factory("cache.ram_gb=0.0001")   # ~107 kB: three entries fit, four do not
    cap = int(0.0001 * (1 << 30))
    for i in range(8):
        h.generate([200 + i] + SYSTEM[:50], max_tokens=4, logit_bias=EOS_OFF)
        assert h.engine.prompt_cache.nbytes <= cap
    assert h.metrics.cache_evictions.labels("ram")._value.get() >= 4
    assert 1 <= len(h.engine.prompt_cache.entries) <= 3
    # the most recent prompt is still there
    again = h.generate([207] + SYSTEM[:50], max_tokens=4, logit_bias=EOS_OFF)
    assert again["cached"] == 50
    # the first one was pushed out: its miss says so
    gone = h.generate([200] + SYSTEM[:50], max_tokens=4, logit_bias=EOS_OFF)
    assert gone["cached"] == 0
    assert h.metrics.cache_misses.labels("evicted")._value.get() >= 1


def test_agents_arriving_together_pay_for_one_prefill(engine_factory) -> None:
    """Requests that share a long prompt prefix with one still being prefilled wait for it
    and then reuse its prefix, instead of all prefilling the same tokens at once."""
    prompts = [SYSTEM + [100 + i, 101 + i] for i in range(4)]
    expected = [cold(engine_factory, "tiny", p) for p in prompts]
    h = engine_factory("scheduler=continuous", "scheduler.prefill_chunk=64")
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=16, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    cached = sorted(g["cached"] for g in got)
    assert cached[0] == 0 and all(c >= len(SYSTEM) for c in cached[1:])
    prefill = h.metrics.step_tokens.labels("prefill")._value.get()
    assert prefill < 2 * len(SYSTEM) + 20   # the shared prefix was prefilled once


def test_hybrid_on_the_ssd_tier_falls_back_to_the_stored_prompt_boundary(engine_factory,
                                                                         tmp_path) -> None:
    """A prompt extending a stored prompt, but not the longer entry its answer made (that one
    cannot be cut back: recurrent layers), reuses the stored prompt from the SSD tier as it
    does from RAM, rather than nothing."""
    a = SYSTEM + [5, 6, 7, 8]
    follow = a + [77, 78, 79]   # diverges from a's stored answer right after a
    expected = cold(engine_factory, "hybrid", follow)
    h = engine_factory("model=hybrid", "cache=ssd", f"cache.ssd.dir={tmp_path}",
                       "cache.ram_gb=0.0001", "cache.ssd.write_behind=false")   # ~2 entries
    h.generate(a, max_tokens=8, logit_bias=EOS_OFF)
    for k in range(2):   # other prompts push a's entries out of RAM, onto the disk
        h.generate([300 + k * 7 + i % 50 for i in range(130)], max_tokens=8, logit_bias=EOS_OFF)
    assert h.metrics.cache_spills.labels("eviction")._value.get() >= 2
    got = h.generate(follow, max_tokens=16, logit_bias=EOS_OFF)
    assert got["cached"] == len(a) - 1   # the stored prompt (its last token is fed)
    assert got["ids"] == expected
    assert h.metrics.cache_hits.labels("ssd")._value.get() == 1


def test_a_bursts_prompt_copies_wait_for_its_first_tokens(engine_factory) -> None:
    """Twelve prompts arriving together are prefilled in one step; their copies into the
    cache are made in the passes after it, while the device runs their first decode steps
    (none before that step is launched), all before the rows finish, and each entry holds
    exactly its prompt: an arrival with the same prompt afterwards reuses it, equal to cold."""
    prompts = [[300 + i] + SYSTEM[i:i + 40] for i in range(12)]
    h = engine_factory("scheduler.max_batch=16", "scheduler.max_num_batched_tokens=1024")
    cache, decoded = h.engine.prompt_cache, h.metrics.step_tokens.labels("decode")
    running = h.engine.scheduler.running
    puts: list[tuple[int, float, int]] = []
    inner = cache.put

    def put(tokens, caches, adapter=None, handed=False):   # engine thread
        out = [len(r.output_ids) for r in running if r.key_ids[:len(tokens)] == list(tokens)]
        puts.append((len(tokens), decoded._value.get(), min(out, default=-1)))
        return inner(tokens, caches, adapter, handed)
    cache.put = put
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=24, logit_bias=EOS_OFF)
                                       for p in prompts]))
    prompt_puts = [(d, o) for n, d, o in puts if n == 40]
    assert len(prompt_puts) == 12, puts
    assert min(d for d, _ in prompt_puts) >= 12   # after the burst's first decode step
    assert max(d for d, _ in prompt_puts) < 12 * 24 - 12   # long before the rows finished
    assert min(o for _, o in prompt_puts) >= 1   # each row's first token was out before it
    cache.put = inner
    for p, g in zip(prompts[:3], got):
        again = h.generate(p, max_tokens=24, logit_bias=EOS_OFF)
        assert again["ids"] == g["ids"] == cold(engine_factory, "tiny", p, 24)
        assert again["cached"] == len(p) - 1


def test_a_prefix_shorter_than_min_reuse_tokens_is_computed_again(engine_factory) -> None:
    """cache.min_reuse_tokens=64: a 40-token shared head is computed again (reused 0, the
    same tokens as cold); the 120-token system prompt is reused as usual."""
    h = engine_factory("cache.min_reuse_tokens=64")
    h.generate(SYSTEM + [5, 6], max_tokens=4, logit_bias=EOS_OFF)
    short = SYSTEM[:40] + [9, 9, 9]
    got = h.generate(short, max_tokens=8, logit_bias=EOS_OFF)
    assert got["cached"] == 0 and got["ids"] == cold(engine_factory, "tiny", short, 8)
    assert h.generate(SYSTEM + [7, 8], max_tokens=4, logit_bias=EOS_OFF)["cached"] == len(SYSTEM)


@pytest.mark.parametrize("kv", [["kv=dense"], ["kv=q8"], ["kv=turbo"],
                                ["kv=q8", "kv.quantized_start=56"],
                                ["kv=paged", "kv.block_size=16", "kv.pool_blocks=256"]],
                         ids=["dense", "q8", "turbo", "q8-delayed", "paged"])
def test_a_prompt_is_reusable_while_its_request_still_decodes(engine_factory, kv) -> None:
    """Whatever the KV layout: once the first request has its first tokens, a second with the
    same prompt reuses all of it but the last token (the prompt's snapshot, made between
    steps, holds exactly the prompt), and it equals the layout's cold run."""
    prompt = SYSTEM[:60] + [11, 12]
    small = ["model=tiny", "model.size=small", *kv]   # head_dim 64: quantizable in groups of 64
    h = engine_factory(*small)

    async def run() -> dict:
        from pipeserve.core.events import TokenDelta
        from pipeserve.core.stream import RequestStream
        stream = RequestStream(asyncio.get_running_loop())
        h.engine.submit(h.request(prompt, max_tokens=48, logit_bias=EOS_OFF), stream)
        seen = 0
        while seen < 3:
            event = await stream.next()
            assert isinstance(event, TokenDelta), event
            seen += len(event.token_ids)
        return (await h.generate_many([h.request(prompt, max_tokens=8, logit_bias=EOS_OFF)]))[0]
    second = asyncio.run(run())
    assert second["cached"] == len(prompt) - 1, (kv, second["cached"])
    alone = engine_factory(*small, "cache=off").generate(prompt, max_tokens=8,
                                                          logit_bias=EOS_OFF)
    assert second["ids"] == alone["ids"]


def _donor_waits(h) -> list[bool]:
    """Each admission's answer to whether it waits for a donor's prefill, as it is given."""
    sched, waited = h.engine.scheduler, []
    inner = sched._donor_prefilling

    def donor(req):   # engine thread, at admission
        waited.append(inner(req))
        return waited[-1]
    sched._donor_prefilling = donor
    return waited


def test_below_min_reuse_tokens_arrivals_never_wait_for_a_donor(engine_factory) -> None:
    """cache.min_reuse_tokens=200: four requests sharing the 120-token system prompt would not
    reuse it, so none waits for another's prefill (they share the first prefill step, each
    computing its own) and none is looked up: all cold, all equal to their cold runs."""
    prompts = [SYSTEM + [100 + i, 101 + i] for i in range(4)]
    expected = [cold(engine_factory, "tiny", p) for p in prompts]
    h = engine_factory("scheduler=continuous", "scheduler.prefill_chunk=256",
                       "cache.min_reuse_tokens=200")
    waited = _donor_waits(h)
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=16, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    assert [g["cached"] for g in got] == [0, 0, 0, 0]
    assert waited and not any(waited)   # each admission asked; none waited
    # the default (0 on a CPU) waits for the donor and reuses its prefix
    h = engine_factory("scheduler=continuous", "scheduler.prefill_chunk=256")
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=16, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert sorted(g["cached"] for g in got)[1:] == [len(SYSTEM)] * 3


def test_arrivals_on_a_cached_head_are_admitted_together(engine_factory) -> None:
    """The system prompt is in the cache; four requests that share it and differ right after
    it arrive together. Each takes the head from the cache, so none waits for another's
    prefill (before, each waited for the one ahead: one admission a step, the H200's 32 and
    128 arrivals on a cached 2,048-token head took 4.6 and 16.7 s), and each equals its cold
    run."""
    prompts = [SYSTEM + [100 + i, 101 + i] for i in range(4)]
    expected = [cold(engine_factory, "tiny", p) for p in prompts]
    h = engine_factory("scheduler=continuous", "scheduler.prefill_chunk=256")
    assert h.generate(SYSTEM + [7, 8], max_tokens=4, logit_bias=EOS_OFF)["cached"] == 0
    waited = _donor_waits(h)
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=16, logit_bias=EOS_OFF)
                                       for p in prompts]))
    assert [g["ids"] for g in got] == expected
    assert [g["cached"] for g in got] == [len(SYSTEM)] * 4
    assert waited and not any(waited)   # each admission asked; none waited
