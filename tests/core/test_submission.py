"""EngineRequest (pipeserve/core/submission.py): the one value and codec both seams send — the
pool's pipe and the distributed wire. What the engine runs after either crossing is the request
that was admitted, field for field."""
from __future__ import annotations

import dataclasses
import json

import orjson
import pytest

from pipeserve.core.events import Submit
from pipeserve.core.submission import EngineRequest
from pipeserve.distributed import wire
from pipeserve.grammar.constraint import Constraint, ConstraintKind
from pipeserve.pool import codec
from pipeserve.request import PromptInput, Request, Requested, SamplingParams

ENGINE_FIELDS = ("request_id", "endpoint", "prompt_ids", "sampling", "stop_token_ids",
                 "constraint", "output_prefix", "adapter", "priority", "checkpoints_at")


def admitted() -> Request:
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=123, logprobs=True,
                        top_logprobs=2, max_tokens=17, stop=["END"],
                        logit_bias={5: -100.0, 1000: 2.5})
    return Request(request_id="chatcmpl-1", endpoint="chat",
                   inputs=PromptInput(messages=[{"role": "user", "content": "hi"}]),
                   requested=Requested(temperature=0.7), prompt_ids=[1, 2, 3, 4], sampling=sp,
                   stop_token_ids=frozenset({0, 2}),
                   constraint=Constraint(ConstraintKind("json_schema"), '{"type": "object"}',
                                         "response_format"),
                   output_prefix="<think>\n", checkpoints_at=(2,), pins=((3, 300.0),),
                   adapter="fr", priority=2)


def engine_view(req: Request) -> dict[str, object]:
    return {name: getattr(req, name) for name in ENGINE_FIELDS}


@pytest.mark.parametrize("dumps, loads", [(orjson.dumps, orjson.loads),
                                          (json.dumps, json.loads)])
def test_a_request_survives_the_codec(dumps, loads) -> None:
    req = admitted()
    sent = EngineRequest.of(req)
    got = EngineRequest.decode(loads(dumps(sent.encode())))
    assert got == sent
    back = got.to_request()
    assert engine_view(back) == engine_view(req)
    assert back.pins == req.pins and back.arrival_s == req.arrival_s
    assert back.sampling.logit_bias == {5: -100.0, 1000: 2.5}


def test_the_value_is_frozen_and_the_request_it_makes_is_fresh() -> None:
    req = admitted()
    sent = EngineRequest.of(req)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sent.priority = 0   # type: ignore[misc]
    a, b = sent.to_request(), sent.to_request()
    a.output_ids.append(7)
    a.prompt_ids.append(9)
    assert b.output_ids == [] and list(sent.prompt_ids) == [1, 2, 3, 4]


def test_pool_pipe_and_distributed_wire_send_the_same_request() -> None:
    """Both seams carry EngineRequest's encoding; the follower keeps its own clock."""
    req = admitted()
    piped = codec.decode_request(codec.loads(codec.dumps(
        {"op": "submit", "req": codec.encode_request(req)}))["req"])
    (cmd,) = wire.decode(wire.encode([Submit(req, None)], None)).commands   # type: ignore[arg-type]
    assert engine_view(piped) == engine_view(req) == engine_view(cmd.request)
    assert piped.arrival_s == req.arrival_s and piped.pins == req.pins
    assert codec.encode_request(req) == EngineRequest.of(req).encode()
