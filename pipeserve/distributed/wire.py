"""The plan wire codec: what rank 0 tells the other ranks each engine step — the commands it
took from its inbox (a new request's token ids and sampling inputs, aborts) and the StepPlan it
scheduled — and what every rank tells rank 0 (its step and sync times, a digest of its
scheduler state, its status). One message is a fixed int32 header with one slot per rank and a
small inline payload, all_summed across the group (each rank writes only its own fields, the
others add zeros); a payload past the inline room follows in a second all_sum. No mlx import:
arrays are numpy; pipeserve/distributed/group.py moves them. Engine thread."""
from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from pipeserve.core.events import Abort, Command, Submit
from pipeserve.core.plan import StepPlan
from pipeserve.core.submission import EngineRequest
from pipeserve.request import FinishReason, Request

MAGIC = 0x50535631      # "PSV1": a header that does not start with it is not ours
HEADER_INTS = 4         # magic, kind, payload bytes, sequence number
SLOT_INTS = 4           # per rank: step µs, sync µs, state digest, status
INLINE_INTS = 256       # payload bytes up to 1 KiB ride in the header's all_sum


class Kind(IntEnum):
    STEP = 1    # a (possibly empty) step: commands and plan in the payload
    STOP = 2    # rank 0 is shutting down: every rank leaves its loop


class Status(IntEnum):
    OK = 0
    FAILED = 1   # the rank cannot go on (its log says why)


@dataclass(frozen=True, slots=True)
class Slot:
    step_us: int     # host time of the rank's previous loop pass, between two syncs
    sync_us: int     # time the rank spent in the previous sync's collectives
    digest: int      # state_digest() of its scheduler, taken before this sync's commands
    status: Status


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    payload_bytes: int
    seq: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded payload: the commands rank 0 applied, in order, then the plan it scheduled as
    (request id, start, num_tokens) rows and (request id, num_tokens) prompt-cache hits."""

    commands: list[Command]
    rows: list[tuple[str, int, int]]
    hits: list[tuple[str, int]]


def header_ints(world_size: int) -> int:
    return HEADER_INTS + SLOT_INTS * world_size + INLINE_INTS


def pack_header(world_size: int, rank: int, slot: Slot, kind: Kind | None = None,
                payload: bytes = b"", seq: int = 0) -> np.ndarray:
    """This rank's contribution to the header all_sum: its own slot, and on rank 0 (`kind` set)
    the kind, the payload length, the sequence number and the inline payload."""
    buf = np.zeros(header_ints(world_size), dtype=np.int32)
    base = HEADER_INTS + SLOT_INTS * rank
    buf[base:base + SLOT_INTS] = (_us(slot.step_us), _us(slot.sync_us), slot.digest,
                                  int(slot.status))
    if kind is not None:
        buf[:HEADER_INTS] = (MAGIC, int(kind), len(payload), seq)
        if len(payload) <= 4 * INLINE_INTS:
            start = HEADER_INTS + SLOT_INTS * world_size
            ints = bytes_to_ints(payload)
            buf[start:start + len(ints)] = ints
    return buf


def unpack_header(buf: np.ndarray, world_size: int) -> tuple[Header, bytes | None]:
    """The summed header, and the inline payload (None when it follows in a second all_sum)."""
    if len(buf) != header_ints(world_size) or int(buf[0]) != MAGIC:
        raise ValueError(f"not a pipeserve plan header (magic {int(buf[0]) if len(buf) else 0:#x}, "
                         f"{len(buf)} ints; rank 0 and this rank run different versions?)")
    kind, size, seq = Kind(int(buf[1])), int(buf[2]), int(buf[3])
    slots = tuple(Slot(*(int(v) for v in buf[HEADER_INTS + SLOT_INTS * r:
                                            HEADER_INTS + SLOT_INTS * (r + 1)][:3]),
                       Status(int(buf[HEADER_INTS + SLOT_INTS * r + 3])))
                  for r in range(world_size))
    inline = None
    if size <= 4 * INLINE_INTS:
        start = HEADER_INTS + SLOT_INTS * world_size
        inline = ints_to_bytes(buf[start:start + INLINE_INTS], size)
    return Header(kind, size, seq, slots), inline


def bytes_to_ints(data: bytes) -> np.ndarray:
    pad = (-len(data)) % 4
    return np.frombuffer(data + b"\0" * pad, dtype=np.int32).copy()


def ints_to_bytes(ints: np.ndarray, size: int) -> bytes:
    return np.ascontiguousarray(ints, dtype=np.int32).tobytes()[:size]


def _us(value: int) -> int:
    return max(0, min(int(value), 2**31 - 1))


# -- payload ------------------------------------------------------------------------------
def encode(commands: Iterable[Command], plan: StepPlan | None) -> bytes:
    """The payload of one step: Submit and Abort commands (others stay on rank 0), the plan."""
    cmds: list[Any] = []
    for cmd in commands:
        if isinstance(cmd, Submit):
            cmds.append({"submit": encode_request(cmd.request)})
        elif isinstance(cmd, Abort):
            cmds.append({"abort": [cmd.request_id, cmd.reason.value]})
    rows = plan_rows(plan)
    hits = plan_hits(plan)
    if not cmds and not rows and not hits:
        return b""
    return json.dumps({"c": cmds, "r": rows, "h": hits}, separators=(",", ":"),
                      ensure_ascii=False).encode()


def decode(payload: bytes) -> Message:
    if not payload:
        return Message([], [], [])
    raw = json.loads(payload.decode())
    cmds: list[Command] = []
    for c in raw["c"]:
        if "submit" in c:
            cmds.append(Submit(decode_request(c["submit"]), None))   # type: ignore[arg-type]
        else:
            rid, reason = c["abort"]
            cmds.append(Abort(rid, FinishReason(reason)))
    return Message(cmds, [(r[0], r[1], r[2]) for r in raw["r"]],
                   [(h[0], h[1]) for h in raw["h"]])


def plan_rows(plan: StepPlan | None) -> list[tuple[str, int, int]]:
    return [] if plan is None else [(r.request_id, r.start, r.num_tokens) for r in plan.rows]


def plan_hits(plan: StepPlan | None) -> list[tuple[str, int]]:
    return [] if plan is None else [(rid, hit.num_tokens) for rid, hit in plan.hits]


def encode_request(req: Request) -> dict[str, Any]:
    """What another rank needs to run a request's rows exactly as rank 0 does: EngineRequest's
    one encoding (pipeserve/core/submission.py), as the pool's pipe sends it."""
    return EngineRequest.of(req).encode()


def decode_request(raw: dict[str, Any]) -> Request:
    """Arrival by this rank's clock: another host's monotonic clock means nothing here."""
    return EngineRequest.decode(raw).to_request(arrival_s=time.perf_counter())


def state_digest(requests: Sequence[Request]) -> int:
    """A 31-bit digest of what every rank's scheduler must agree on between steps: each
    request's id, counters and last output token. Equal digests on every rank at every sync
    mean the ranks sampled the same tokens and moved the same counters."""
    h = 0
    for req in requests:
        last = req.output_ids[-1] if req.output_ids else -1
        h = zlib.crc32(f"{req.request_id}:{req.num_computed_tokens}:{len(req.output_ids)}:"
                       f"{last}:{req.status.value};".encode(), h)
    return h & 0x7FFFFFFF
