"""The typed values one engine step passes between its stages: the scheduler's StepPlan, a
prompt-cache hit, drafts, and what sampling or verification produced (host copies in
StepOutput). No mlx import: arrays inside are opaque to this module. Engine thread."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeserve.request import Request


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One request's share of a step: it feeds `num_tokens` tokens starting at position
    `start` (the KV before `start` exists), then `drafts` when it verifies them. A row feeding
    prompt tokens only (all but the prompt's last) is a prefill chunk; a row feeding the token
    at `num_prompt_tokens - 1` or later decodes and samples."""

    request: Request
    start: int
    num_tokens: int
    drafts: tuple[int, ...] = ()
    max_drafts: int = 0   # drafts the budget leaves room for (draft≠none, decode rows only)
    num_forced: int = 0   # of `drafts`, the leading ones its grammar forces (fast-forward)
    # whether the row feeds its prompt's last token or later (decodes and samples); set once
    # here, read ~12 times a row a step (128 rows: ~1,500 property calls a step)
    samples: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples",
                           self.start + self.num_tokens >= len(self.request.prompt_ids))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def width(self) -> int:
        """Positions this row feeds: its tokens plus its drafts."""
        return self.num_tokens + len(self.drafts)

    def token_ids(self) -> list[int]:
        """The token ids this row feeds, from the host (a prefill chunk's; a draft model's
        catch-up may reach into the output)."""
        req, end = self.request, self.start + self.num_tokens
        if end <= req.num_prompt_tokens:
            return req.prompt_ids[self.start:end]
        return (req.prompt_ids + req.output_ids)[self.start:end]

    def known_input(self) -> int | None:
        """The token a decode row feeds, when it is on the host (the prompt's last token, or
        output already read back); None when it is still on the device (pipelined decode)."""
        req, pos = self.request, self.start
        p = req.num_prompt_tokens
        if pos < p:
            return req.prompt_ids[pos]
        return req.output_ids[pos - p] if pos - p < len(req.output_ids) else None


@dataclass(frozen=True, slots=True)
class CacheHit:
    """What the prompt cache supplies for a request at admission (cache_lookup's result; the
    scheduler applies it): KV for the first `num_tokens` tokens of prompt + `output_ids`.
    A plain prefix hit has no output; a checkpoint resume replays `output_ids`."""

    num_tokens: int
    caches: list[Any]
    output_ids: tuple[int, ...] = ()
    key: list[int] | None = None   # the sampler's PRNG key saved with a checkpoint


@dataclass(frozen=True, slots=True)
class LookupResult:
    """cache_lookup's answer for a request at admission; the scheduler, the owner of the row's
    state, applies it. `hit`: what the prompt cache supplies (None: nothing reused);
    `checkpoints_at`: the prompt positions whose state persist still has to keep (the
    request's own, less those the hit covers or a trimmable cache does not need);
    `cache_miss`: why prompt tokens are recomputed (pipeserve/prompt_cache/explain.py). What
    the lookup did not decide (a checkpoint resume, a prompt too short to look up) carries the
    request's own value."""

    hit: CacheHit | None
    checkpoints_at: tuple[int, ...]
    cache_miss: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Who runs this step and with how many tokens, under `scheduler.max_num_batched_tokens`.
    `hits` are the KV the prompt cache supplied to rows admitted now (the row store adopts
    them before the forward)."""

    rows: tuple[PlannedRow, ...]
    hits: tuple[tuple[str, CacheHit], ...] = ()
    # the rows feeding prompt chunks, and those that sample, in plan order: split once here,
    # read by several stages a step
    prefill: tuple[PlannedRow, ...] = field(init=False, compare=False, repr=False)
    decode: tuple[PlannedRow, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(r for r in self.rows if not r.samples))
        object.__setattr__(self, "decode", tuple(r for r in self.rows if r.samples))

    @property
    def num_tokens(self) -> int:
        return sum(r.width for r in self.rows)

    @property
    def has_drafts(self) -> bool:
        return any(r.drafts for r in self.rows)

    def with_drafts(self, drafts: Drafts) -> StepPlan:
        got = drafts.tokens
        if not got:
            return self
        forced = drafts.forced
        rows = tuple(replace(r, drafts=tuple(got[r.request_id]),
                             num_forced=forced.get(r.request_id, 0))
                     if got.get(r.request_id) else r for r in self.rows)
        return replace(self, rows=rows)


@dataclass(slots=True)
class Logits:
    """The forward's output for the rows that sample, in `order` (request ids): `logits` is
    (rows, vocab) for a plain step or (rows, width, vocab) when rows verify drafts; `hidden`
    the trunk's hidden states per row id, (1, positions, H) from that row's `start` (draft=mtp).
    Arrays are lazy; what a rollback needs stays in the row store. `failed`: rows whose own
    prompt chunk could not run (a vision or audio tower that raised on that row's input); they
    fail alone and are not in `order`."""

    order: list[str]
    logits: Any = None
    width: int = 1
    hidden: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass(slots=True)
class Sampled:
    """One token per sampling row (lazy arrays, `order` as Logits): what the engine reads back.
    `sync`: the next step needs these tokens on the host first (a grammar's next mask)."""

    order: list[str]
    token_ids: Any
    logprobs: Any = None
    top_ids: Any = None
    top_logprobs: Any = None
    sync: bool = False
    failed: dict[str, BaseException] = field(default_factory=dict)

    def arrays(self) -> list[Any]:
        return [a for a in (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)
                if a is not None]


@dataclass(slots=True)
class RowOutput:
    """Host copy of one row's step result: the tokens it emits (accepted drafts + one), their
    logprobs and top alternatives when asked, and how many of its drafts the target kept."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    num_drafts: int = 0     # drafts a proposer offered (not counting forced ones)
    num_accepted: int = 0   # drafts kept, forced ones included
    num_forced: int = 0     # of those kept, the ones its grammar forced (fast-forward)


@dataclass(slots=True)
class StepOutput:
    """What `scheduler.update(plan, output)` applies: per request id, its RowOutput (rows that
    only prefilled have none); `failed` rows failed on their own and emit nothing."""

    rows: dict[str, RowOutput] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Drafts:
    """The draft stage's result: proposed token ids per request id. `sync`: the step's tokens
    must reach the host before the next is planned (proposals continue host tokens)."""

    tokens: Mapping[str, Sequence[int]] = field(default_factory=dict)
    sync: bool = False
    forced: Mapping[str, int] = field(default_factory=dict)   # leading drafts a grammar forces


NO_DRAFTS = Drafts()
