"""EngineRequest: what the engine needs of a request, as one frozen value, and its one codec —
the pool's pipe (pipeserve/pool/codec.py) and the distributed wire (pipeserve/distributed/wire.py)
both send it. The engine side turns it back into the Request whose row state the scheduler
moves. Pure data, any thread; no mlx."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeserve.grammar.constraint import Constraint, ConstraintKind
from pipeserve.request import PromptInput, Request, SamplingParams

_SAMPLING = [f.name for f in dataclasses.fields(SamplingParams)]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """The request as admitted: ids, resolved sampling (a seed is set by then), stops, the
    structured-output constraint, adapter, queue priority, the prompt positions the prompt
    cache keeps (`checkpoints_at`) and pins (`pins`: position, ttl s), and its arrival
    (perf_counter: CLOCK_MONOTONIC, one clock for the processes of one host)."""

    request_id: str
    endpoint: str
    prompt_ids: tuple[int, ...]
    sampling: tuple[tuple[str, Any], ...]   # SamplingParams' fields, by name
    stop_token_ids: frozenset[int]
    constraint: tuple[str, str, str | None] | None   # (kind, source, param)
    output_prefix: str
    adapter: str | None
    priority: int
    checkpoints_at: tuple[int, ...]
    pins: tuple[tuple[int, float], ...]
    arrival_s: float

    @classmethod
    def of(cls, req: Request) -> EngineRequest:
        c = req.constraint
        return cls(req.request_id, req.endpoint, tuple(req.prompt_ids),
                   tuple((name, getattr(req.sampling, name)) for name in _SAMPLING),
                   frozenset(req.stop_token_ids),
                   None if c is None else (c.kind.value, c.source, c.param),
                   req.output_prefix, req.adapter, req.priority, tuple(req.checkpoints_at),
                   tuple(req.pins), req.arrival_s)

    def to_request(self, arrival_s: float | None = None) -> Request:
        """A fresh Request for the engine to run (`arrival_s`: this process's own, when the
        sender's clock means nothing here)."""
        sp = dict(self.sampling)
        sp["logit_bias"] = dict(sp["logit_bias"])
        c = self.constraint
        return Request(request_id=self.request_id, endpoint=self.endpoint,
                       inputs=PromptInput(token_ids=list(self.prompt_ids)),
                       prompt_ids=list(self.prompt_ids), sampling=SamplingParams(**sp),
                       stop_token_ids=self.stop_token_ids,
                       constraint=None if c is None else Constraint(ConstraintKind(c[0]), c[1],
                                                                    c[2]),
                       output_prefix=self.output_prefix, adapter=self.adapter,
                       arrival_s=self.arrival_s if arrival_s is None else arrival_s,
                       priority=self.priority, checkpoints_at=self.checkpoints_at,
                       pins=self.pins)

    def encode(self) -> dict[str, Any]:
        """JSON-able (logit_bias as [token id, bias] pairs: JSON keys are strings)."""
        sp = dict(self.sampling)
        sp["logit_bias"] = [[int(k), float(v)] for k, v in sp["logit_bias"].items()]
        return {"id": self.request_id, "endpoint": self.endpoint, "prompt": list(self.prompt_ids),
                "sampling": sp, "stop_ids": sorted(self.stop_token_ids),
                "constraint": None if self.constraint is None else list(self.constraint),
                "prefix": self.output_prefix, "adapter": self.adapter,
                "priority": self.priority, "checkpoints": list(self.checkpoints_at),
                "pins": [list(p) for p in self.pins], "arrival": self.arrival_s}

    @classmethod
    def decode(cls, d: dict[str, Any]) -> EngineRequest:
        sp = dict(d["sampling"])
        sp["logit_bias"] = {int(k): float(v) for k, v in sp["logit_bias"]}
        c = d["constraint"]
        return cls(d["id"], d["endpoint"], tuple(d["prompt"]),
                   tuple((name, sp[name]) for name in _SAMPLING),
                   frozenset(d["stop_ids"]), None if c is None else (c[0], c[1], c[2]),
                   d["prefix"], d["adapter"], d["priority"], tuple(d["checkpoints"]),
                   tuple((int(at), float(ttl)) for at, ttl in d["pins"]), d["arrival"])

