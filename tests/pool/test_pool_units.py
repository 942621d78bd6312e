"""Unit tests of the model pool's pure parts, no model and no process: the wire codec, the
members' composed configs, the pool schema's checks, routing by `model`, and the merged
/metrics exposition."""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeserve.config import ServeConfig
from pipeserve.errors import AdmissionRejected, ConfigError, NotFound, StageError
from pipeserve.core.events import Failed, Finished, TokenDelta
from pipeserve.grammar.constraint import Constraint
from pipeserve.pool import codec
from pipeserve.pool.config import PoolConfig, PoolMemberConfig
from pipeserve.pool.members import compose_members, member_overrides
from pipeserve.pool.metrics import merge
from pipeserve.pool.pool import ModelPool
from pipeserve.request import FinishReason, PromptInput, Request, SamplingParams, TokenLogprob
from tests.conftest import make_config


def test_a_request_crosses_the_wire_with_what_the_engine_reads() -> None:
    sp = SamplingParams(temperature=0.7, top_k=5, logit_bias={3: -100.0, 17: 2.5}, seed=2**63,
                        logprobs=True, top_logprobs=2, max_tokens=9, stop=["\n\n"])
    req = Request(request_id="r1", endpoint="chat", inputs=PromptInput(text="hi"),
                  prompt_ids=[1, 2, 3], sampling=sp, stop_token_ids=frozenset({0, 2}),
                  constraint=Constraint.regex("[a-z]+", "response_format"),
                  output_prefix="<think>", adapter="none", priority=0,
                  checkpoints_at=(2,), pins=((2, 300.0),))
    back = codec.decode_request(codec.loads(codec.dumps({"req": codec.encode_request(req)}))["req"])
    assert back.request_id == "r1" and back.prompt_ids == [1, 2, 3]
    assert back.sampling == sp and back.sampling.logit_bias == {3: -100.0, 17: 2.5}
    assert back.stop_token_ids == frozenset({0, 2}) and back.constraint == req.constraint
    assert back.output_prefix == "<think>" and back.adapter == "none"
    assert back.arrival_s == req.arrival_s
    assert back.priority == 0 and back.checkpoints_at == (2,) and back.pins == ((2, 300.0),)


def test_events_and_errors_cross_the_wire_as_they_were() -> None:
    events = [TokenDelta("r", [5, 6], [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)])], 3),
              TokenDelta("r", [7]),
              Finished("r", FinishReason.LENGTH, 10, 4, 3, {"batch_size_max": 2,
                                                            "speculation": {"proposed": 1}}),
              Failed("r", AdmissionRejected("busy", retry_after_s=3, code="queue_full")),
              Failed("s", StageError("sample", ["s"], RuntimeError("x")))]
    wire = codec.loads(codec.dumps({"ev": [codec.encode_event(e) for e in events]}))["ev"]
    back = [codec.decode_event(d) for d in wire]
    assert back[:3] == events[:3]
    for got, sent in zip(back[3:], events[3:]):
        assert isinstance(got, Failed) and type(got.error) is type(sent.error)
        assert (got.error.status, got.error.error_type, got.error.message, got.error.code) == \
            (sent.error.status, sent.error.error_type, sent.error.message, sent.error.code)


def test_a_step_crosses_as_one_columnar_message_in_the_engine_order() -> None:
    lp = [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprob(6, -0.5, [])]
    # the batch size so far travels with each row's tokens (a stop string's record needs it)
    step = [TokenDelta("a", [5, 6], lp, 2), TokenDelta("b", [7]), TokenDelta("a", [8], None, 3),
            Finished("a", FinishReason.STOP, 3, 3), TokenDelta("c", [1]),
            Failed("b", AdmissionRejected("busy", retry_after_s=3, code="queue_full"))]
    msg = codec.loads(codec.dumps(codec.encode_step(step, 4, 2)))
    assert (msg["rid"], msg["n"], msg["tok"]) == (["a", "b", "a", "c"], [2, 1, 1, 1],
                                                  [5, 6, 7, 8, 1])
    assert (msg["w"], msg["r"]) == (4, 2)
    back = codec.decode_step(msg)
    # each row's tokens in the order sent, then the ends (a row's tokens precede its end)
    assert back[:4] == [step[0], step[1], step[2], step[4]] and back[4] == step[3]
    assert isinstance(back[5], Failed) and back[5].error.code == "queue_full"
    plain = codec.loads(codec.dumps(codec.encode_step([TokenDelta("a", [1])], 0, 1)))
    assert plain["lp"] is None and codec.decode_step(plain) == [TokenDelta("a", [1])]


def test_the_child_says_whether_its_model_cache_rewinds() -> None:
    """The server process holds no weights: the child's limits say whether the model's cache
    cuts back to any prefix, so a chat's history end is not rendered a second time for a
    checkpoint the engine would drop (unknown stays unknown: every chat is marked)."""
    from pipeserve.core.limits import EngineLimits

    loaded = SimpleNamespace(config={"vocab_size": 32}, tokenizer=[0] * 32, max_context=64,
                             adapters=None, vision=None)
    cfg = make_config()
    for rewinds in (True, False, None):
        sent = EngineLimits(64, 32, max_rows=4, device="cpu", rewinds=rewinds)
        wire = codec.loads(codec.dumps(codec.encode_limits(sent)))
        assert codec.decode_limits(wire, cfg, loaded).rewinds is rewinds


def _adapter(adapter_id: str) -> Any:
    from pathlib import Path

    from pipeserve.adapters.lora import Adapter
    return Adapter(id=adapter_id, path=Path("/a") / adapter_id, digest="0123456789abcdef",
                   fine_tune_type="lora", rank=4, scale=2.0, num_layers=2,
                   target_modules=("self_attn.q_proj",), nbytes=128)


def test_the_childs_adapters_cross_at_ready_and_after_every_swap() -> None:
    """The server process checks a request's adapter against the child's published set: it
    crosses in the ready message's limits and in every swap reply, and a reply's set is
    published before the handler waiting on the swap is answered."""
    from pipeserve.adapters.lora import AdapterSet
    from pipeserve.core.events import AdapterSwap
    from pipeserve.core.limits import EngineLimits
    from pipeserve.pool.proxy import ChildEngine

    mounted = AdapterSet([_adapter("lora"), _adapter("terse")], "lora")
    mounted.retired = {"old": (_adapter("old"), 5.0)}   # a running request may still name it
    loaded = SimpleNamespace(config={"vocab_size": 32}, tokenizer=[0] * 32, max_context=64,
                             adapters=None, vision=None)
    sent = EngineLimits(64, 32, adapters=mounted.snapshot())
    wire = codec.loads(codec.dumps(codec.encode_limits(sent)))
    got = codec.decode_limits(wire, make_config(), loaded).adapters
    assert got.ids == ["lora", "terse"] and got.default == "lora" and not got.merged
    assert got.adapters["terse"] == mounted.adapters["terse"]   # every field, the path too
    assert got.identity("old") == "old@0123456789abcdef"
    assert got.canonical("terse", "adapter") == "terse" and got.canonical("lora", "m") is None
    with pytest.raises(NotFound, match="'old', which is not mounted; mounted: lora, terse"):
        got.canonical("old", "adapter")
    engine = ChildEngine("m", make_config(), metrics=None)   # type: ignore[arg-type]
    engine.limits = dataclasses.replace(sent, adapters=got)
    cmd = AdapterSwap("terse", False)
    seen: list[Any] = []
    cmd.future.add_done_callback(lambda f: seen.append(engine.limits.adapters.ids))
    engine._commands[7] = cmd
    after = AdapterSet([_adapter("lora")], "lora")
    engine._control(codec.loads(codec.dumps({"op": "reply", "n": 7, **codec.swap_reply_fields(
        _answered({"id": "terse", "deleted": False}), after)})))
    assert cmd.future.result() == {"id": "terse", "deleted": False} and seen == [["lora"]]
    refused = AdapterSwap("lora", False)
    engine._commands[8] = refused
    error = Future()
    error.set_exception(NotFound("adapter 'x' is not mounted", param="id", code="adapter_nf"))
    engine._control(codec.loads(codec.dumps({"op": "reply", "n": 8,
                                             **codec.swap_reply_fields(error, after)})))
    with pytest.raises(NotFound, match="adapter 'x' is not mounted") as info:
        refused.future.result()
    assert (info.value.param, info.value.code, info.value.status) == ("id", "adapter_nf", 404)


def _answered(result: Any) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


def test_a_member_inherits_the_launch_overrides_but_not_the_pool_or_hydra() -> None:
    launch = ["model=tiny", "model.cache_dir=/m", "pool=example", "pool.max_resident=1",
              "hydra.run.dir=/r", "kv=q8", "server.port=9"]
    got = member_overrides(launch, ["model=tiny", "model.arch=llama", "kv=dense"], "a")
    assert got == ["model.cache_dir=/m", "server.port=9", "model=tiny", "model.arch=llama",
                   "kv=dense", "model.name=a"]


def test_pool_example_composes_two_models_of_different_architectures(tmp_path) -> None:
    cfg = make_config("pool=example", f"model.cache_dir={tmp_path}")
    members = compose_members(cfg, ["model=tiny", f"model.cache_dir={tmp_path}", "pool=example"])
    assert members is not None and list(members) == ["tiny-qwen3", "tiny-llama"]
    assert [m.model.arch.value for m in members.values()] == ["qwen3", "llama"]
    for model_id, m in members.items():
        assert isinstance(m, ServeConfig) and m.model.name == model_id and m.pool is None
        assert m.model.cache_dir == str(tmp_path)
    assert compose_members(make_config(), []) is None   # one model: in-process, as before
    one = compose_members(make_config("server.isolate=true"), ["server.isolate=true"])
    assert one is not None and list(one) == ["tiny"]
    # members share the device: each RAM tier keeps the fixed size unless set; one model alone
    # has it fitted at load
    assert [m.cache.ram_gb for m in members.values()] == [8.0, 8.0]
    assert one["tiny"].cache.ram_gb is None
    set_ = compose_members(cfg, ["model=tiny", f"model.cache_dir={tmp_path}", "pool=example",
                                 "cache.ram_gb=2"])
    assert [m.cache.ram_gb for m in set_.values()] == [2.0, 2.0]


@pytest.mark.parametrize("launch,member,message", [
    (["server.isolate=false"], ["model=tiny"], "server.isolate=false with pool"),
    ([], ["kv=nope"], "pool.models.m"),
    ([], ["model.arch=gpt"], "pool.models.m"),
    ([], ["server.port=1"], "a member sets its model"),
])
def test_a_bad_member_fails_at_launch_naming_it(launch, member, message) -> None:
    cfg = make_config("pool=example", *launch)
    cfg.pool = PoolConfig(models={"m": PoolMemberConfig(member)})
    with pytest.raises(ConfigError, match=message):
        compose_members(cfg, launch)


def test_a_member_may_mount_adapters_of_its_own() -> None:
    cfg = make_config("pool=example")
    cfg.pool = PoolConfig(models={"m": PoolMemberConfig(["model.adapter_dir=/a",
                                                         "model.adapter=x"]),
                                  "n": PoolMemberConfig([])})
    members = compose_members(cfg, [])
    assert members is not None
    assert members["m"].model.adapter_ids == ["x"] and members["n"].model.adapter_ids == []


def test_a_pool_or_isolation_with_distributed_serving_is_refused() -> None:
    for extra in ("pool=example", "server.isolate=true"):   # pipeserve/distributed/config.py
        with pytest.raises(ConfigError, match="pool= / server.isolate=true with distributed"):
            make_config("distributed=tensor", extra)


@pytest.mark.parametrize("kw,message", [
    ({"models": {}}, "pool.models is empty"),
    ({"models": {"a:b": PoolMemberConfig()}}, "no ':'"),
    ({"models": {"a": PoolMemberConfig()}, "default": "b"}, "pool.default=b"),
    ({"models": {"a": PoolMemberConfig()}, "max_resident": 0}, "max_resident"),
    ({"models": {"a": PoolMemberConfig()}, "idle_unload_s": -1}, "idle_unload_s"),
    ({"models": {"a": PoolMemberConfig()}, "memory_gb": 0}, "memory_gb"),
    ({"models": {"a": PoolMemberConfig()}, "load_timeout_s": 0}, "load_timeout_s"),
])
def test_pool_schema_refuses_what_cannot_work(kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        PoolConfig(**kw)


def test_routing_by_model_names_the_ids_when_unknown() -> None:
    cfg = make_config("pool=example")
    cfg.pool = PoolConfig(models={"a": PoolMemberConfig(), "b": PoolMemberConfig()})
    members = {"a": make_config("model.name=a"), "b": make_config("model.name=b")}
    pool = ModelPool(cfg, members, SimpleNamespace(draining=False), CollectorRegistry())
    assert pool.member("b").id == "b" and pool.member("b:lora1").id == "b"
    assert pool.member(None).id == "a" and pool.member("").id == "a"   # the first: the default
    with pytest.raises(NotFound) as e:
        pool.member("gpt-4o")
    assert "'gpt-4o'" in e.value.message and "a, b" in e.value.message
    assert e.value.param == "model" and e.value.code == "model_not_found"
    with pytest.raises(NotFound):
        pool.member(["a"])
    body = pool.models_body()
    assert [(m["id"], m["loaded"], m["state"]) for m in body["data"]] == \
        [("a", False, "unloaded"), ("b", False, "unloaded")]


def test_merged_exposition_labels_every_sample_with_its_model() -> None:
    def text(n: float) -> str:
        r = CollectorRegistry()
        Counter("pipeserve_requests", "r", ["endpoint"], registry=r).labels("chat").inc(n)
        Gauge("pipeserve_queue_depth", "q", registry=r).set(n)
        return generate_latest(r).decode()
    out = merge([("", text(1), {"pipeserve_requests_total"}, ()),
                 ("a", text(2), None, ()), ("b", text(3), None, {"pipeserve_queue_depth"})])
    fams = {f.name: f for f in text_string_to_metric_families(out.decode())}
    requests = {s.labels["model"]: s.value for s in fams["pipeserve_requests"].samples
                if s.name == "pipeserve_requests_total"}
    assert requests == {"": 1.0, "a": 2.0, "b": 3.0}
    depth = {s.labels["model"]: s.value for s in fams["pipeserve_queue_depth"].samples}
    assert depth == {"a": 2.0}   # the server's dropped (not kept), b's dropped
    assert out.decode().count("# TYPE pipeserve_requests_total counter") == 1


def test_a_childs_last_message_before_it_exits_is_not_lost() -> None:
    """A child that fails to load says why (start_failed) and exits at once. The reader gets
    that message and then end of file in the same read (poll() is true at EOF too); the
    reason must still reach the user, not 'exited while loading'."""
    import time

    from pipeserve.pool.proxy import SPAWN, ChildEngine
    engine = ChildEngine("m", make_config(), metrics=None)   # type: ignore[arg-type]
    parent_end, child_end = SPAWN.Pipe()
    child_end.send_bytes(codec.dumps({"op": "start_failed", "error": "ConfigError: no such path"}))
    child_end.close()   # the child has exited: its last message, then end of file
    engine._conn, engine._proc = parent_end, SPAWN.Process(target=time.sleep, args=(0,))
    engine._proc.start()
    engine._proc.join()
    engine._read()
    assert str(engine.startup_error) == "ConfigError: no such path"
    assert not engine.wait_ready(0)
