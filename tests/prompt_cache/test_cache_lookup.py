"""The cache_lookup stage is a query: on a real engine's prompt cache it answers with the hit,
the checkpoint positions the row still needs and why tokens are recomputed, and leaves the
request as it was; the scheduler writes that answer on the row, and the miss reaches the
finished event (usage's cache_miss_reason) as before. A cache that can trim (tiny) keeps no
history checkpoint; one that cannot (hybrid: recurrent layers) keeps those past the hit."""
from __future__ import annotations

import asyncio
import copy

import pytest

from tests.prompt_cache.test_prompt_cache import EOS_OFF, SYSTEM

N = len(SYSTEM)


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_lookup_answers_and_the_scheduler_writes_the_row(engine_factory, model: str) -> None:
    h = engine_factory(f"model={model}")
    h.generate(SYSTEM + [5, 6, 7, 8], max_tokens=4, logit_bias=EOS_OFF)
    turn = h.request(SYSTEM + [9, 10, 11, 12, 13], max_tokens=2, logit_bias=EOS_OFF)
    turn.checkpoints_at = (0, 20, N, N + 4)   # the last prompt token's state is always kept
    served = asyncio.run(h.generate_many([turn]))[0]
    miss = served["extras"]["cache_miss"]
    if model == "tiny":   # the shared system prompt is reused, the miss is where they part
        assert served["cached"] == N and turn.checkpoints_at == ()
        assert miss["reason"] == "diverged_at" and miss["index"] == N
    else:   # no state at position 120 yet: computed, and the history boundary kept
        assert served["cached"] == 0 and turn.checkpoints_at == (20, N)
        assert miss == {"reason": "no_snapshot", "shared_tokens": N, "reused_tokens": 0}
    assert turn.cache_miss == miss

    h.close()   # the engine thread has ended: this thread may drive its scheduler and stages
    again = h.request(SYSTEM + [9, 10, 11, 50, 51], max_tokens=2)
    again.checkpoints_at = (0, 20, N, N + 2, N + 4)
    before = copy.deepcopy(again)
    found = h.engine.step.lookup(again)
    assert again == before   # a query: nothing on the request moved
    if model == "tiny":
        assert found.hit.num_tokens == N + 3 and found.checkpoints_at == ()
        assert found.cache_miss["reason"] == "diverged_at"
        assert found.cache_miss["index"] == N + 3
    else:   # the turn's checkpoint at 120 is reused; 122 is still to keep
        assert found.hit.num_tokens == N and found.checkpoints_at == (N + 2,)
        assert found.cache_miss == {"reason": "no_snapshot", "shared_tokens": N + 3,
                                    "reused_tokens": N}
    scheduler = h.engine.scheduler
    scheduler.add(again)
    plan = scheduler.schedule()   # admission: the scheduler looks it up and writes the row
    assert [rid for rid, _ in plan.hits] == [again.request_id]
    assert again.checkpoints_at == found.checkpoints_at
    assert again.cache_miss == found.cache_miss
    assert again.num_cached_tokens == again.num_computed_tokens == found.hit.num_tokens
