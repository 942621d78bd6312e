"""The distributed plan wire codec (pipeserve/distributed/wire.py) and the group's verdicts,
without a second process: each rank's contribution is packed as it would be, and the all_sum
is numpy's sum of them."""
from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from pipeserve.distributed import wire
from pipeserve.distributed.group import DistributedError, Group
from pipeserve.distributed.shard import check_divisible
from pipeserve.errors import ConfigError
from pipeserve.core.engine import EngineState
from pipeserve.core.events import Abort, Submit
from pipeserve.grammar.constraint import Constraint
from pipeserve.metrics import Metrics
from pipeserve.core.plan import CacheHit, PlannedRow, StepPlan
from pipeserve.request import FinishReason, PromptInput, Request, SamplingParams
from tests.conftest import make_config


def request(rid: str = "r1", **sampling: object) -> Request:
    sp = SamplingParams(**{"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                           "repetition_penalty": 1.1, "presence_penalty": 0.2,
                           "logit_bias": {17: -100.0, 3: 2.5}, "seed": 2**63 + 5,
                           "logprobs": True, "top_logprobs": 3, "max_tokens": 40,
                           "stop": ["\n\n", "END"], **sampling})
    return Request(request_id=rid, endpoint="chat", inputs=PromptInput(token_ids=[1, 2, 3]),
                   prompt_ids=[5, 6, 7, 8, 900], sampling=sp, stop_token_ids=frozenset({0, 2}),
                   constraint=Constraint.regex("[a-z]+", "guided_regex"),
                   output_prefix="<think>", adapter="none")


def all_sum(parts: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(parts), axis=0).astype(np.int32)


def test_submit_abort_and_plan_round_trip() -> None:
    req = request()
    plan = StepPlan((PlannedRow(req, 0, 4), PlannedRow(request("r2"), 12, 1)),
                    hits=(("r2", CacheHit(12, [])),))
    msg = wire.decode(wire.encode([Submit(req, None), Abort("r9", FinishReason.STOP)], plan))
    got = msg.commands[0]
    assert isinstance(got, Submit) and got.stream is None
    r = got.request
    assert (r.request_id, r.endpoint, r.prompt_ids, r.stop_token_ids, r.output_prefix,
            r.adapter) == ("r1", "chat", [5, 6, 7, 8, 900], frozenset({0, 2}), "<think>", "none")
    assert r.sampling == req.sampling   # every field, logit_bias keys back to ints
    assert r.constraint == req.constraint and r.grammar is None   # each rank compiles its own
    assert r.output_ids == [] and r.num_computed_tokens == 0
    assert msg.commands[1] == Abort("r9", FinishReason.STOP)
    assert msg.rows == [("r1", 0, 4), ("r2", 12, 1)]
    assert msg.hits == [("r2", 12)]


def test_an_idle_pass_is_an_empty_payload() -> None:
    assert wire.encode([], None) == b""
    assert wire.decode(b"") == wire.Message([], [], [])


def test_header_sums_every_ranks_slot_and_carries_a_small_payload_inline() -> None:
    world = 3
    payload = wire.encode([Submit(request(), None)], None)
    assert len(payload) <= 4 * wire.INLINE_INTS
    parts = [wire.pack_header(world, 0, wire.Slot(1500, 200, 77, wire.Status.OK),
                              wire.Kind.STEP, payload, seq=9)]
    parts += [wire.pack_header(world, r, wire.Slot(1000 * r, 10 * r, 77, wire.Status.OK))
              for r in (1, 2)]
    header, inline = wire.unpack_header(all_sum(parts), world)
    assert (header.kind, header.payload_bytes, header.seq) == (wire.Kind.STEP, len(payload), 9)
    assert [s.step_us for s in header.slots] == [1500, 1000, 2000]
    assert [s.sync_us for s in header.slots] == [200, 10, 20]
    assert all(s.digest == 77 and s.status is wire.Status.OK for s in header.slots)
    assert inline == payload


def test_a_large_payload_follows_in_a_second_sum() -> None:
    reqs = [Submit(request(f"r{i}"), None) for i in range(20)]
    payload = wire.encode(reqs, None)
    assert len(payload) > 4 * wire.INLINE_INTS
    lead = wire.pack_header(2, 0, wire.Slot(0, 0, 1, wire.Status.OK), wire.Kind.STEP, payload)
    header, inline = wire.unpack_header(all_sum([lead, wire.pack_header(
        2, 1, wire.Slot(0, 0, 1, wire.Status.OK))]), 2)
    assert inline is None and header.payload_bytes == len(payload)
    ints = all_sum([wire.bytes_to_ints(payload), np.zeros((len(payload) + 3) // 4, np.int32)])
    assert wire.decode(wire.ints_to_bytes(ints, header.payload_bytes)).commands[19].request \
        .request_id == "r19"


def test_slot_times_are_clamped_to_int32_and_a_foreign_header_is_refused() -> None:
    buf = wire.pack_header(1, 0, wire.Slot(-5, 10**12, 3, wire.Status.FAILED), wire.Kind.STOP)
    header, _ = wire.unpack_header(buf, 1)
    assert header.slots[0] == wire.Slot(0, 2**31 - 1, 3, wire.Status.FAILED)
    assert header.kind is wire.Kind.STOP
    with pytest.raises(ValueError, match="not a pipeserve plan header"):
        wire.unpack_header(np.zeros(wire.header_ints(1), np.int32), 1)
    with pytest.raises(ValueError, match="not a pipeserve plan header"):
        wire.unpack_header(buf, 2)   # another world size: another length


def test_state_digest_sees_counters_and_tokens() -> None:
    a, b = request("a"), request("b")
    d0 = wire.state_digest([a, b])
    assert d0 == wire.state_digest([request("a"), request("b")])
    assert 0 <= d0 < 2**31
    a.output_ids.append(11)
    d1 = wire.state_digest([a, b])
    assert d1 != d0
    a.output_ids[-1] = 12   # same count, another token: a different digest
    assert wire.state_digest([a, b]) != d1
    a.num_computed_tokens += 1
    assert wire.state_digest([a, b]) not in (d0, d1)


def test_the_group_stops_on_a_digest_or_status_mismatch() -> None:
    group = Group(make_config("distributed=tensor"), Metrics(CollectorRegistry()))
    assert group.size == 1   # no mlx.launch here: the lone group
    ok = wire.Slot(0, 0, 5, wire.Status.OK)

    def header(*slots: wire.Slot) -> wire.Header:
        return wire.Header(wire.Kind.STEP, 0, 3, slots)
    group._check(header(ok, ok), True)
    with pytest.raises(DistributedError, match="rank 1's scheduler state .* differs from rank 0"):
        group._check(header(ok, wire.Slot(0, 0, 6, wire.Status.OK)), True)
    with pytest.raises(DistributedError, match="rank 1 reported a failure at sync 3"):
        group._check(header(ok, wire.Slot(0, 0, 5, wire.Status.FAILED)), True)


def test_tensor_parallel_needs_heads_and_columns_the_ranks_divide() -> None:
    check_divisible({"num_attention_heads": 8, "num_key_value_heads": 4,
                     "intermediate_size": 2048}, 4)
    with pytest.raises(ConfigError, match="num_key_value_heads is 2, not a multiple of 4"):
        check_divisible({"num_attention_heads": 8, "num_key_value_heads": 2}, 4)
    with pytest.raises(ConfigError, match="num_attention_heads is 9, not a multiple of 2"):
        check_divisible({"text_config": {"num_attention_heads": 9}}, 2)


def test_distributed_settings_are_checked_at_launch() -> None:
    assert make_config().distributed.name == "none"
    assert not make_config().distributed.enabled
    with pytest.raises(ConfigError, match="distributed.heartbeat_s must be in"):
        make_config("distributed=tensor", "distributed.heartbeat_s=0")
    with pytest.raises(ConfigError, match="must be longer than distributed.heartbeat_s"):
        make_config("distributed=pipeline", "distributed.timeout_s=1", "distributed.heartbeat_s=2")
    with pytest.raises(ConfigError, match="distributed.linger_s must be >= 0"):
        make_config("distributed=tensor", "distributed.linger_s=-1")


def test_the_watchdog_clock_starts_at_the_first_sync() -> None:
    """Ranks finish loading at different times: one waiting in the first collective for a rank
    still loading is not stuck, however long it waits; once the group has synced, a rank that
    has not synced again for distributed.timeout_s is."""
    group = Group(make_config("distributed=tensor", "distributed.timeout_s=2"),
                  Metrics(CollectorRegistry()))

    class Stopped:   # the watchdog thread sees an engine that is no longer running, and ends
        state = EngineState.STOPPED
    group._arm(Stopped())   # type: ignore[arg-type]
    start = time.perf_counter()
    assert not group.stalled(start + 3600)
    group._done(start)   # a sync ends: the clock starts
    synced = group._synced_s
    assert synced is not None and synced >= start
    assert not group.stalled(synced + 1.9)
    assert group.stalled(synced + 2.0)
