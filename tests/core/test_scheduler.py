"""Scheduler decisions, without a model: synthetic requests, fabricated step results.
Chunked prompts then one decode token per step, pipelined steps in flight, stops, aborts,
the packed token budget (many prompts in one step, decode never starved, drafts counted
against it), counters moved only by update(), cache hits applied at admission, and the
device-fitted limits."""
from __future__ import annotations

import pytest

from pipeserve.errors import ConfigError
from pipeserve.core.events import Finished, TokenDelta
from pipeserve.memory import MemoryModel
from pipeserve.core.plan import CacheHit, Drafts, LookupResult, RowOutput, StepOutput, StepPlan
from pipeserve.request import (
    FinishReason,
    PromptInput,
    Request,
    RequestStatus,
    SamplingParams,
)
from pipeserve.core.scheduler import Limits, Scheduler
from tests.conftest import make_config

STOP = 0


def req(n_prompt: int, max_tokens: int, rid: str = "r") -> Request:
    return Request(request_id=rid, endpoint="test", inputs=PromptInput(token_ids=[1] * n_prompt),
                   prompt_ids=list(range(1, n_prompt + 1)),
                   sampling=SamplingParams(max_tokens=max_tokens),
                   stop_token_ids=frozenset({STOP}))


def sched(*overrides: str) -> Scheduler:
    return Scheduler(make_config(*overrides))


def budget_sched(budget: int, max_batch: int = 16, *extra: str) -> Scheduler:
    return sched("scheduler=continuous", f"scheduler.max_batch={max_batch}",
                 f"scheduler.max_num_batched_tokens={budget}", *extra)


def output(plan: StepPlan, token: int = 5) -> StepOutput:
    """One token for every row of the plan that samples (what sample + read-back give)."""
    return StepOutput(rows={r.request_id: RowOutput([token]) for r in plan.rows if r.samples})


def run_step(s: Scheduler, token: int = 5) -> tuple[StepPlan, list]:
    plan = s.schedule()
    assert plan is not None
    return plan, list(s.update(plan, output(plan, token)))


def memory(kv_bytes_per_token: int = 1) -> MemoryModel:
    return MemoryModel(weight_bytes=0, kv_bytes_per_token=kv_bytes_per_token, window_tokens=None,
                       windowed_bytes_per_token=0, state_bytes_per_row=0, prefill_temp_bytes=0,
                       device_bytes=1 << 40, max_context=1 << 20, enforced=False)


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(r.request_id, r.start, r.num_tokens) for r in plan.rows]


# -- one request: chunks, decode, in-flight steps, stops, aborts --------------------------
def test_prompt_is_chunked_then_decoded_one_token_per_step() -> None:
    s = sched("scheduler=serial", "scheduler.prefill_chunk=4")
    r = req(10, 3)
    s.add(r)
    plans = [run_step(s)[0] for _ in range(4)]
    assert [shape(p) for p in plans] == [[("r", 0, 4)], [("r", 4, 4)], [("r", 8, 1)],
                                         [("r", 9, 1)]]
    assert [p.rows[0].samples for p in plans] == [False, False, False, True]
    # 9 prompt tokens in chunks, then the last one decodes and samples
    assert r.num_computed_tokens == 10 and r.output_ids == [5]
    plan, _ = run_step(s)
    assert shape(plan) == [("r", 10, 1)] and plan.rows[0].known_input() == 5
    assert r.num_computed_tokens == 11 and r.output_ids == [5, 5]


def test_length_finish_and_no_overscheduling_with_steps_in_flight() -> None:
    s = sched("scheduler=serial")
    r = req(2, 2)
    s.add(r)
    run_step(s)                           # prefill token 0
    b1 = s.schedule()                     # decode 1
    b2 = s.schedule()                     # decode 2, planned before b1's result is read
    assert shape(b1) == [("r", 1, 1)] and shape(b2) == [("r", 2, 1)]
    assert s.outputs_ahead("r") == 2 and s.tokens_ahead("r") == 2
    assert s.schedule() is None           # max_tokens planned: nothing more to schedule
    events = list(s.update(b1, output(b1, 7))) + list(s.update(b2, output(b2, 8)))
    assert r.output_ids == [7, 8] and r.finish_reason is FinishReason.LENGTH
    assert r.status is RequestStatus.FINISHED and not s.has_work()
    assert [type(e).__name__ for _, e in events] == ["TokenDelta", "TokenDelta", "Finished"]
    assert s.outputs_ahead("r") == 0 and s.tokens_ahead("r") == 0


def test_stop_token_finishes_and_in_flight_result_is_discarded() -> None:
    s = sched("scheduler=serial")
    r = req(1, 10)
    s.add(r)
    b1 = s.schedule()
    b2 = s.schedule()                     # queued before b1's result is known
    assert b1.rows[0].samples and b2.rows[0].samples
    events = list(s.update(b1, output(b1, STOP)))
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.STOP
    assert [type(e) for _, e in events] == [Finished]
    assert list(s.update(b2, output(b2, 5))) == []
    assert r.output_ids == [] and r.num_computed_tokens == 1
    assert s.tokens_ahead("r") == 0 and not s.has_work()


def test_stop_token_among_accepted_drafts_cuts_the_output() -> None:
    s = sched("draft=ngram", "draft.num_draft_tokens=4")
    r = req(1, 10)
    s.add(r)
    plan = s.schedule().with_drafts(Drafts({"r": [6, STOP, 7]}))
    events = list(s.update(plan, StepOutput({"r": RowOutput([6, STOP, 7, 8], num_drafts=3,
                                                             num_accepted=3)})))
    assert r.output_ids == [6] and r.finish_reason is FinishReason.STOP
    assert [type(e) for _, e in events] == [TokenDelta, Finished]


def test_fifo_order_and_abort_of_waiting_request() -> None:
    s = sched("scheduler=serial")
    a, b, c = req(1, 1, "a"), req(1, 1, "b"), req(1, 1, "c")
    for r in (a, b, c):
        s.add(r)
    assert s.abort("b") is b and b.finish_reason is FinishReason.ABORT
    assert b.status is RequestStatus.FINISHED
    plan, _ = run_step(s)
    assert [r.request for r in plan.rows] == [a] and a.finish_reason is FinishReason.LENGTH
    assert [r.request for r in s.schedule().rows] == [c]
    assert s.abort("zzz") is None


def test_abort_of_running_request_discards_its_in_flight_step() -> None:
    s = budget_sched(64, 4)
    a, b = req(3, 5, "a"), req(3, 5, "b")
    s.add(a)
    s.add(b)
    run_step(s)                           # both prefill
    plan = s.schedule()                   # both decode, in flight
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert a not in s.running
    events = list(s.update(plan, output(plan, 9)))
    assert [(q.request_id, type(e)) for q, e in events] == [("b", TokenDelta)]
    assert a.output_ids == [] and b.output_ids == [9]
    s.release("a")
    assert s.tokens_ahead("a") == 0 and s.outputs_ahead("a") == 0
    assert [r.request_id for r in s.schedule().rows] == ["b"]


def test_failed_row_emits_nothing_and_others_go_on() -> None:
    s = budget_sched(64, 4)
    a, b = req(1, 5, "a"), req(1, 5, "b")
    s.add(a)
    s.add(b)
    plan = s.schedule()
    out = output(plan, 4)
    out.failed["a"] = ValueError("bad row")
    events = list(s.update(plan, out))
    assert [q.request_id for q, _ in events] == ["b"]
    assert a.output_ids == [] and a.num_computed_tokens == 0 and b.output_ids == [4]


# -- the packed budget ---------------------------------------------------------------------
def test_many_prompts_share_one_step_under_the_budget() -> None:
    s = budget_sched(512)
    reqs = [req(50, 4, f"p{i}") for i in range(10)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    # every prompt's chunk in one forward: all but its last token (that one decodes)
    assert shape(plan) == [(f"p{i}", 0, 49) for i in range(10)]
    assert plan.num_tokens == 490 and not plan.decode
    list(s.update(plan, output(plan)))
    plan, _ = run_step(s)
    assert shape(plan) == [(f"p{i}", 49, 1) for i in range(10)]
    assert all(r.samples for r in plan.rows)
    assert all(r.output_ids == [5] for r in reqs)


def test_prompts_fill_the_budget_fifo_and_the_rest_go_next_step() -> None:
    s = budget_sched(128)
    reqs = [req(50, 4, f"p{i}") for i in range(10)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert shape(plan) == [("p0", 0, 49), ("p1", 0, 49), ("p2", 0, 30)]
    assert plan.num_tokens == 128
    list(s.update(plan, output(plan)))
    plan = s.schedule()
    # p0/p1 decode first (1 token each), then p2's rest, then later prompts FIFO
    assert shape(plan) == [("p0", 49, 1), ("p1", 49, 1), ("p2", 30, 19), ("p3", 0, 49),
                           ("p4", 0, 49), ("p5", 0, 9)]
    assert plan.num_tokens == 128
    # every request eventually finishes, never over the budget
    list(s.update(plan, output(plan)))
    while s.has_work():
        plan, _ = run_step(s)
        assert plan.num_tokens <= 128
    assert all(r.output_ids == [5] * 4 and r.finish_reason is FinishReason.LENGTH
               for r in reqs)


def test_prefill_chunk_caps_one_request_per_step() -> None:
    s = budget_sched(512, 16, "scheduler.prefill_chunk=32")
    for i in range(3):
        s.add(req(50, 2, f"p{i}"))
    plan = s.schedule()
    assert shape(plan) == [("p0", 0, 32), ("p1", 0, 32), ("p2", 0, 32)]


def test_decode_rows_are_never_starved_by_prompts() -> None:
    s = budget_sched(64, 16)
    decoders = [req(2, 50, f"d{i}") for i in range(4)]
    for r in decoders:
        s.add(r)
    run_step(s)                           # their prompts
    prompts = [req(400, 2, f"p{i}") for i in range(8)]
    for r in prompts:
        s.add(r)
    plan, _ = run_step(s)   # their first tokens: more of them than prompts, so alone
    assert shape(plan) == [(f"d{i}", 1, 1) for i in range(4)]
    for _ in range(4):
        plan, _ = run_step(s)
        # every decoding row gets its 1 token, planned first; prompts take the rest
        assert [(r.request_id, r.num_tokens) for r in plan.rows[:4]] == \
            [(f"d{i}", 1) for i in range(4)]
        assert all(r.samples for r in plan.rows[:4])
        assert not any(r.samples for r in plan.rows[4:])
        assert plan.num_tokens == 64
    assert all(len(r.output_ids) == 5 for r in decoders)


def test_decode_row_count_never_exceeds_the_budget_at_its_minimum() -> None:
    # max_num_batched_tokens == max_batch: decode rows alone fill the step, prompts wait
    s = budget_sched(4, 4)
    for i in range(3):
        s.add(req(1, 10, f"d{i}"))
    s.add(req(30, 2, "p"))
    plan, _ = run_step(s)   # three first tokens: the one prompt waits a step for them
    assert shape(plan) == [("d0", 0, 1), ("d1", 0, 1), ("d2", 0, 1)]
    plan, _ = run_step(s)
    assert shape(plan) == [("d0", 1, 1), ("d1", 1, 1), ("d2", 1, 1), ("p", 0, 1)]
    plan, _ = run_step(s)
    assert shape(plan) == [("d0", 2, 1), ("d1", 2, 1), ("d2", 2, 1), ("p", 1, 1)]


def test_first_tokens_are_not_held_by_fewer_late_prompts() -> None:
    """A burst split by its arrivals (round 10: 29 rows, then 3 more): the step that samples
    the first group's first tokens runs no prompt chunk of the late group, whose forward would
    be evaluated before them; the late prompts run in the next step, never later. Where the
    late prompts are as many or more, they share the step as before."""
    s = budget_sched(4096, 64)
    early = [req(20, 4, f"e{i}") for i in range(3)]
    for r in early:
        s.add(r)
    plan, _ = run_step(s)                 # the early prompts
    assert shape(plan) == [(f"e{i}", 0, 19) for i in range(3)]
    s.add(req(20, 4, "late"))
    plan, _ = run_step(s)                 # their first tokens alone
    assert shape(plan) == [(f"e{i}", 19, 1) for i in range(3)]
    plan, _ = run_step(s)                 # then the late prompt beside their next tokens
    assert shape(plan) == [(f"e{i}", 20, 1) for i in range(3)] + [("late", 0, 19)]
    # as many late prompts as first tokens: one step for both
    s = budget_sched(4096, 64)
    for i in range(2):
        s.add(req(20, 4, f"e{i}"))
    run_step(s)
    for i in range(2):
        s.add(req(20, 4, f"l{i}"))
    plan, _ = run_step(s)
    assert shape(plan) == [("e0", 19, 1), ("e1", 19, 1), ("l0", 0, 19), ("l1", 0, 19)]


# -- drafts count against the budget ------------------------------------------------------
def draft_sched(budget: int, max_batch: int = 16, *extra: str) -> Scheduler:
    return budget_sched(budget, max_batch, "draft=ngram", "draft.num_draft_tokens=4", *extra)


def decoding(s: Scheduler, n: int, max_tokens: int = 50) -> list[Request]:
    rows = [req(1, max_tokens, f"d{i}") for i in range(n)]
    for r in rows:
        s.add(r)
    run_step(s)   # each samples its first token: now decoding
    return rows


def test_draft_room_reduces_what_prompts_get() -> None:
    s = draft_sched(64)
    decoding(s, 2)
    s.add(req(100, 2, "p"))
    plan = s.schedule()
    # each decoding row: 1 token + room for 4 drafts; the prompt gets 64 - 2 * 5
    assert [(r.request_id, r.num_tokens, r.max_drafts) for r in plan.rows] == \
        [("d0", 1, 4), ("d1", 1, 4), ("p", 54, 0)]
    assert sum(r.num_tokens + r.max_drafts for r in plan.rows) == 64


def test_draft_room_shrinks_evenly_when_the_budget_is_tight() -> None:
    s = draft_sched(16, 4)
    decoding(s, 4)
    plan = s.schedule()
    # 16 - 4 decode tokens leaves 12: 3 drafts each instead of 4
    assert [r.max_drafts for r in plan.rows] == [3, 3, 3, 3]
    assert sum(r.num_tokens + r.max_drafts for r in plan.rows) <= 16


def test_draft_room_never_past_max_tokens() -> None:
    s = draft_sched(64)
    r = req(1, 3)
    s.add(r)
    plan = s.schedule()
    assert plan.rows[0].max_drafts == 2   # 3 tokens left: the sampled one + 2 drafts


def test_disable_by_batch_size_turns_drafting_off() -> None:
    s = draft_sched(64, 16, "draft.disable_by_batch_size=2")
    decoding(s, 3)
    assert [r.max_drafts for r in s.schedule().rows] == [0, 0, 0]
    s2 = draft_sched(64, 16, "draft.disable_by_batch_size=2")
    decoding(s2, 2)
    assert [r.max_drafts for r in s2.schedule().rows] == [4, 4]


def test_no_draft_room_without_a_proposer() -> None:
    s = budget_sched(64)
    decoding(s, 2)
    assert [r.max_drafts for r in s.schedule().rows] == [0, 0]


def test_update_counts_accepted_drafts_only() -> None:
    s = draft_sched(64)
    [r] = decoding(s, 1)
    assert r.num_computed_tokens == 1 and r.output_ids == [5]
    plan = s.schedule().with_drafts(Drafts({"d0": [7, 8, 9, 10]}))
    assert plan.has_drafts and plan.num_tokens == 5 and plan.rows[0].width == 5
    assert s.tokens_ahead("d0") == 1   # the ledger holds the planned input, not the drafts
    out = StepOutput({"d0": RowOutput([7, 8, 11], num_drafts=4, num_accepted=2)})
    events = list(s.update(plan, out))
    # the input and 2 accepted drafts are kept; the 2 rejected drafts' KV does not count
    assert r.num_computed_tokens == 1 + 1 + 2
    assert r.output_ids == [5, 7, 8, 11]
    assert r.spec_proposed == 4 and r.spec_accepted == 2
    assert [e.token_ids for _, e in events] == [[7, 8, 11]]
    assert s.tokens_ahead("d0") == 0
    nxt = s.schedule()
    assert nxt.rows[0].start == 4 and nxt.rows[0].known_input() == 11


def test_update_with_all_drafts_rejected_moves_by_one() -> None:
    s = draft_sched(64)
    [r] = decoding(s, 1)
    plan = s.schedule().with_drafts(Drafts({"d0": [7, 8]}))
    list(s.update(plan, StepOutput({"d0": RowOutput([3], num_drafts=2, num_accepted=0)})))
    assert r.num_computed_tokens == 2 and r.output_ids == [5, 3]


# -- counters move only in update ---------------------------------------------------------
def test_schedule_leaves_counters_and_the_ledger_holds_planned_tokens() -> None:
    s = budget_sched(512, 16, "scheduler.prefill_chunk=16")
    a, b = req(40, 3, "a"), req(5, 3, "b")
    s.add(a)
    s.add(b)
    p1 = s.schedule()
    p2 = s.schedule()
    assert shape(p1) == [("a", 0, 16), ("b", 0, 4)]
    assert shape(p2) == [("b", 4, 1), ("a", 16, 16)]   # b decodes (planned first), a chunks on
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 0
    assert a.output_ids == [] and b.output_ids == []
    assert s.tokens_ahead("a") == 32 and s.tokens_ahead("b") == 5
    assert s.outputs_ahead("b") == 1 and s.outputs_ahead("a") == 0
    list(s.update(p1, output(p1)))
    assert a.num_computed_tokens == 16 and b.num_computed_tokens == 4
    assert s.tokens_ahead("a") == 16 and s.tokens_ahead("b") == 1
    list(s.update(p2, output(p2)))
    assert a.num_computed_tokens == 32 and b.num_computed_tokens == 5 and b.output_ids == [5]
    assert s.tokens_ahead("a") == 0 and s.tokens_ahead("b") == 0


# -- cache hits at admission --------------------------------------------------------------
def test_cache_hit_is_applied_at_admission() -> None:
    s = sched("scheduler=serial")
    seen: list[str] = []
    hit = CacheHit(30, ["kv-of-30-tokens"])

    def lookup(r: Request) -> LookupResult:
        seen.append(r.request_id)
        return LookupResult(hit if r.request_id == "a" else None, (), None)
    s.lookup = lookup
    a, b = req(50, 1, "a"), req(50, 1, "b")
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert seen == ["a"]                  # b is not admitted yet (max_batch 1): not looked up
    assert plan.hits == (("a", hit),)
    assert a.num_computed_tokens == 30 and a.num_cached_tokens == 30
    assert shape(plan) == [("a", 30, 19)]
    list(s.update(plan, output(plan)))
    assert a.num_computed_tokens == 49
    plan, _ = run_step(s)
    assert plan.hits == () and seen == ["a"]   # looked up once, at admission
    assert a.finish_reason is FinishReason.LENGTH
    plan = s.schedule()
    assert seen == ["a", "b"] and plan.hits == () and shape(plan) == [("b", 0, 49)]
    assert b.num_cached_tokens == 0


def test_cache_hit_of_the_whole_prompt_but_one_decodes_at_once() -> None:
    s = sched("scheduler=serial")
    s.lookup = lambda r: LookupResult(CacheHit(9, []), (), None)
    r = req(10, 2)
    s.add(r)
    plan = s.schedule()
    assert shape(plan) == [("r", 9, 1)] and plan.rows[0].samples
    assert plan.rows[0].known_input() == 10 and r.num_cached_tokens == 9


def test_checkpoint_hit_replays_output_and_goes_on() -> None:
    s = sched("scheduler=serial")
    hit = CacheHit(10 + 3 - 1, [], output_ids=(4, 5, 6), key=[1, 2])
    s.lookup = lambda r: LookupResult(hit, (), None)
    r = req(10, 5)
    s.add(r)
    plan = s.schedule()
    assert r.output_ids == [4, 5, 6] and r.replay_ids == [4, 5, 6]
    assert plan.hits[0][1].key == [1, 2]   # the sampler's key travels with the hit
    assert r.num_cached_tokens == 9 and r.num_computed_tokens == 12
    assert shape(plan) == [("r", 12, 1)] and plan.rows[0].known_input() == 6
    assert plan.rows[0].samples
    list(s.update(plan, output(plan, 7)))
    run_step(s, 8)
    assert r.output_ids == [4, 5, 6, 7, 8] and r.finish_reason is FinishReason.LENGTH


# -- limits ---------------------------------------------------------------------------------
def test_serial_pins_max_batch_to_one() -> None:
    s = sched("scheduler=serial")
    assert s.max_batch == 1
    for i in range(3):
        s.add(req(1, 2, f"r{i}"))
    plan = s.schedule()
    assert [r.request_id for r in plan.rows] == ["r0"] and len(s.running) == 1
    with pytest.raises(ConfigError, match="max_batch must be 1"):
        make_config("scheduler=serial", "scheduler.max_batch=2")


def test_limits_fit_the_device() -> None:
    cfg = make_config("scheduler=continuous")
    gpu, cpu = Limits.fit(cfg, on_gpu=True), Limits.fit(cfg, on_gpu=False)
    assert gpu.max_batch > cpu.max_batch and gpu.max_num_batched_tokens > cpu.max_num_batched_tokens
    assert cpu.max_batch == Scheduler(cfg).max_batch
    assert cpu.prefill_chunk <= cpu.max_num_batched_tokens


def test_limits_respect_explicit_values() -> None:
    cfg = make_config("scheduler=continuous", "scheduler.max_batch=3",
                      "scheduler.max_num_batched_tokens=100", "scheduler.prefill_chunk=64")
    for on_gpu in (True, False):
        assert Limits.fit(cfg, on_gpu) == Limits(3, 100, 64)
    # a prompt chunk never exceeds the step's budget
    cfg = make_config("scheduler=continuous", "scheduler.max_batch=4",
                      "scheduler.max_num_batched_tokens=100")
    assert Limits.fit(cfg, on_gpu=True) == Limits(4, 100, 100)
    with pytest.raises(ConfigError, match="at least scheduler.max_batch"):
        make_config("scheduler.max_batch=16", "scheduler.max_num_batched_tokens=8")


def test_explicit_token_budget_is_kept_when_max_batch_is_fitted() -> None:
    """A user who sets only the token budget gets that budget; the fitted max_batch fits
    under it (rather than the default row count raising the explicit budget)."""
    cfg = make_config("scheduler=continuous", "scheduler.max_num_batched_tokens=100")
    for on_gpu in (True, False):
        lim = Limits.fit(cfg, on_gpu)
        assert lim.max_num_batched_tokens == 100, lim
        assert lim.max_batch <= 100 and lim.prefill_chunk <= 100
    cfg = make_config("scheduler=continuous", "scheduler.max_num_batched_tokens=4")
    assert Limits.fit(cfg, on_gpu=False).max_num_batched_tokens == 4


def test_configured_limits_replace_the_defaults() -> None:
    s = sched("scheduler=continuous")
    s.configure(Limits(2, 40, 40), memory(), None)
    for i in range(3):
        s.add(req(30, 2, f"p{i}"))
    plan = s.schedule()
    assert shape(plan) == [("p0", 0, 29), ("p1", 0, 11)] and len(s.running) == 2


def test_kv_budget_holds_the_fifo_head() -> None:
    s = sched("scheduler=continuous")
    s.configure(Limits(8, 512, 512), memory(kv_bytes_per_token=1), kv_budget=100)
    a, b, c = req(40, 10, "a"), req(40, 10, "b"), req(1, 1, "c")   # 50 + 50 + 2 bytes
    for r in (a, b, c):
        s.add(r)
    s.schedule()
    assert [r.request_id for r in s.running] == ["a", "b"] and s.kv_reserved == 100
    assert list(s.waiting) == [c]          # c fits no more: it waits behind the budget
    s.abort("a")
    assert s.kv_reserved == 50
    s.schedule()
    assert [r.request_id for r in s.running] == ["b", "c"]


def test_the_memory_gate_admits_while_active_memory_and_prompts_fit() -> None:
    """admission.memory_high_water: a request joins only while MLX's active memory, the prompts
    of rows still to prefill and its own prompt's KV (twice: its row and its copy into the
    batch) stay under the ceiling; the first row always runs; each held request is counted
    once; the head keeps its place (FIFO) and joins once memory is freed."""
    s = sched("scheduler=continuous")
    active = [100]
    s.configure(Limits(8, 4096, 512), memory(kv_bytes_per_token=1), kv_budget=None,
                active_memory=lambda: active[0], memory_ceiling=400)
    for i in range(4):
        s.add(req(60, 4, f"r{i}"))   # 120 bytes each: its 60 tokens' KV, twice
    plan = s.schedule()
    # r0 runs (the first always does) and counts as still to come: 100 + 120 + 120 <= 400
    assert [r.request_id for r in s.running] == ["r0", "r1"] and s.memory_held == 1
    active[0] = 340   # their prompts' forward is in flight, copies and all
    assert s.schedule() is not None and len(s.running) == 2 and s.memory_held == 1
    list(s.update(plan, output(plan)))
    active[0] = 220   # joined: each prompt's KV once
    s.schedule()
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]
    assert [r.request_id for r in s.waiting] == ["r3"] and s.memory_held == 2
    active[0] = 2000   # far past the ceiling: nothing joins while a row runs
    for rid in ("r0", "r1", "r2"):
        s.abort(rid)
    s.schedule()
    assert [r.request_id for r in s.running] == ["r3"]   # the batch was empty: it runs


def test_the_memory_gate_takes_room_from_the_prompt_cache_first() -> None:
    """Live rows come before cached prefixes: a request the gate would hold first has the
    prompt cache drop its oldest entries (what each freed counted back), and waits only once
    the cache has nothing left to give."""
    s = sched("scheduler=continuous")
    active, entries = [300], [50, 20]   # 300 bytes active, 70 of them the cache's two entries

    def reclaim() -> bool:
        if not entries:
            return False
        active[0] -= entries.pop()
        return True
    s.configure(Limits(8, 4096, 512), memory(kv_bytes_per_token=1), kv_budget=None,
                active_memory=lambda: active[0], memory_ceiling=400, reclaim=reclaim)
    for i in range(3):
        s.add(req(30, 4, f"r{i}"))   # 60 bytes each
    s.schedule()
    # r0 runs; r1 needs 60 of the 400 - 300 - 60 = 40 left: the oldest entry out (+20) lets
    # it in; r2 then needs 60 of 0: the last entry out (+50) is not enough, and it waits
    assert [r.request_id for r in s.running] == ["r0", "r1"] and entries == []
    assert [r.request_id for r in s.waiting] == ["r2"] and s.memory_held == 1


def test_memory_high_water_is_a_share() -> None:
    with pytest.raises(ConfigError, match="memory_high_water is 1.5"):
        make_config("admission.memory_high_water=1.5")
    assert make_config("admission.memory_high_water=0").admission.memory_high_water == 0


def test_arrivals_wait_only_for_a_prefilling_row_with_their_head() -> None:
    """With a prompt cache, an arrival whose first shared_min tokens match a row still
    prefilling waits for it (then reuses its prefix); arrivals with other heads go ahead in the
    same pass, and one admitted in a pass is the donor of those behind it."""
    s = sched("scheduler.max_batch=16")
    s.lookup = lambda r: LookupResult(None, (), None)

    def with_head(rid: str, head: int, n: int = 100) -> Request:
        r = req(n, 8, rid)
        r.prompt_ids = [head] * 64 + list(range(1000, 1000 + n - 64))
        return r
    for rid, head in (("a1", 1), ("b", 2), ("a2", 1), ("c", 3), ("a3", 1)):
        s.add(with_head(rid, head))
    s._admit()
    assert [r.request_id for r in s.running] == ["a1", "b", "c"]
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]
    s._admit()   # a1 still prefills: they still wait
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]
    short = with_head("s", 1, n=64)   # no longer than shared_min: never waits
    s.add(short)
    s._admit()
    assert "s" in [r.request_id for r in s.running]
    run_step(s)   # a1's prompt runs whole (it fits the budget): a donor no longer
    s._admit()   # a2 goes ahead; a3 now waits for a2, admitted in this very pass
    assert [r.request_id for r in s.running][-1] == "a2"
    assert [r.request_id for r in s.waiting] == ["a3"]



def test_a_plan_splits_its_rows_once_as_they_stood_when_it_was_made() -> None:
    """A plan's prefill and decode rows are fixed when it is made (the stages read them several
    times a step): a request whose prompt grows while its step is in flight (as a preemption's
    fold grows it) still counts as the sampling row the scheduler planned, so the step's token
    is emitted and its in-flight count settled as planned."""
    s = budget_sched(64)
    s.add(req(1, 4, "short"))
    s.add(req(40, 4, "long"))
    plan = s.schedule()
    assert plan is not None
    assert [r.request_id for r in plan.decode] == ["short"]
    assert [r.request_id for r in plan.prefill] == ["long"]
    assert [r.samples for r in plan.rows] == [True, False]
    assert s.outputs_ahead("short") == 1
    drafted = plan.with_drafts(Drafts({"short": [4]}))
    assert [(r.request_id, r.drafts) for r in drafted.decode] == [("short", (4,))]
    short = plan.decode[0].request
    short.prompt_ids = short.prompt_ids + [7, 8, 9]
    assert [r.request_id for r in plan.decode] == ["short"]
    events = list(s.update(plan, output(plan)))
    assert [(r.request_id, type(e).__name__) for r, e in events] == [("short", "TokenDelta")]
    assert s.outputs_ahead("short") == 0
