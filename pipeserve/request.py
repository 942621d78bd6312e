"""Per-request state: what the client asked for and how far the engine got.
Built on the event loop; after Submit only the engine thread touches it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeserve.grammar.constraint import Constraint, Matcher


class FinishReason(str, Enum):
    STOP = "stop"        # a stop token or stop string
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # the client went away
    ERROR = "error"      # a fault; the stream got a Failed event


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    """Resolved sampling settings of one request (request > server config > generation_config)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 1.0  # multiplicative, 1.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context_size: int = 20   # tokens of history the penalties look at
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class PromptInput:
    """What the client sent, protocol-neutral; the tokenize stage turns it into ids."""

    messages: list[dict[str, Any]] | None = None   # chat turns, already normalised
    text: str | None = None                         # a raw completion prompt
    token_ids: list[int] | None = None              # a pre-tokenised completion prompt
    tools: list[dict[str, Any]] | None = None      # OpenAI function-tool shape
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_choice: str = "auto"                       # auto | none | required | named
    tool_name: str | None = None                    # the tool a `named` choice forces
    media: list[Any] = field(default_factory=list)  # pipeserve.vision.media.MediaPart, in prompt
                                                    # order; messages hold {"type": "image"} parts
    parallel_tool_calls: bool = True                # false: at most one call per turn
    continue_final: bool = False                    # the last (assistant) message is continued,
                                                    # not closed: its text opens the answer
    reasoning_budget: int | None = None             # most thinking tokens (thinking.budget_tokens,
                                                    # max_reasoning_tokens); None: by effort
    # Anthropic cache_control: (index into `messages` whose end is a breakpoint, ttl seconds)
    cache_breakpoints: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Requested:
    """The sampling and scheduling fields the client set explicitly, as the protocol parsers
    read them from the body (None: not sent, so the model's and the server's defaults apply;
    pipeserve/stages/admission.py merges them). Immutable: a later writer (the priority
    header, a background response, each choice's seed) makes a new one with
    dataclasses.replace."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    penalty_context_size: int | None = None   # the body's repetition_context_size
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None   # (token id, bias), as sent
    stop: tuple[str, ...] | None = None   # () when the body has none: no default stop applies
    # scheduling (pipeserve/eventloop/latency.py): the queue order as sent (0..9 or a class
    # name; admission checks it), and a latency the answer must meet
    priority: object = None
    deadline_ms: int | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def given(self) -> dict[str, Any]:
        """The fields set (not None), in this order, as SamplingParams takes them (stop a
        list, logit_bias a dict)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "stop":
                value = list(value)
            elif f.name == "logit_bias":
                value = dict(value)
            out[f.name] = value
        return out


@dataclass(slots=True)
class Request:
    """One generation. Fields below `engine state` belong to the engine thread after Submit."""

    request_id: str
    endpoint: str
    inputs: PromptInput
    requested: Requested = field(default_factory=Requested)   # the fields the client set
    prompt_ids: list[int] = field(default_factory=list)       # set by tokenize
    sampling: SamplingParams = field(default_factory=SamplingParams)  # set by admission
    stop_token_ids: frozenset[int] = frozenset()              # set by tokenize
    constraint: Constraint | None = None   # set by the adapter: structured output to enforce
    grammar: Matcher | None = None         # set by admission: the constraint compiled; advanced
                                           # by the step (grammar.rows.catch_up), engine thread
    output_prefix: str = ""   # set by tokenize: assistant text the prompt already opened
                              # (an open <think>, a forced tool-call start); output follows it
    # set by tokenize: prompt positions whose state the prompt cache should keep (the end of a
    # chat's history before the generation prompt); at admission the scheduler drops those
    # cache_lookup's answer says are not needed
    checkpoints_at: tuple[int, ...] = ()
    pins: tuple[tuple[int, float], ...] = ()   # set by tokenize: (prompt position, ttl s) of
                                               # each cache_control breakpoint
    adapter: str | None = None   # set by the protocol adapter: the mounted adapter id its rows run
                                 # with, "none" for the base model; None: the launch default
    media: Any = None   # set by tokenize: pipeserve.vision.rows.PromptMedia (images; None: text)
    arrival_s: float = field(default_factory=time.perf_counter)
    # set by tokenize: what the request asked for that the server could not honour and ignored
    # (the response's x-pipeserve-warning header says so)
    warnings: list[str] = field(default_factory=list)
    # set by the front: the volatile spans removed from the prompt (server.volatile_spans)
    volatile: list[str] = field(default_factory=list)
    priority: int = 5   # set by admission: 0 (most urgent) .. 9; the scheduler's queue order
    priority_class: str = "default"   # set by admission: the label of `priority` in metrics
    # engine state
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose KV is computed (moved by scheduler.update)
    num_cached_tokens: int = 0        # prompt tokens taken from the prompt cache
    finish_reason: FinishReason | None = None
    kv_reserved_bytes: int = 0        # KV this row reserved under admission.kv_budget_gb
    batch_size_max: int = 0           # largest engine step this row ran in (for the record)
    checkpointed_tokens: int = 0      # output tokens covered by this row's latest checkpoint
    replay_ids: list[int] | None = None   # resumed output the client has not seen yet
    preemptions: int = 0              # times the scheduler took its row for a more urgent one
    num_folded: int = 0               # output tokens a preemption moved into prompt_ids
    first_token_s: float | None = None
    last_token_s: float = 0.0
    spec_proposed: int = 0            # draft tokens offered for this row (usage.speculation)
    spec_accepted: int = 0            # of those, accepted by the target
    num_forwarded: int = 0            # output tokens its grammar forced, appended a step at a
                                      # time (draft.fast_forward; usage.speculation.forwarded)
    queue_wait_s: float | None = None   # arrival until the scheduler gave it a row
    # set by the scheduler from cache_lookup's answer: why prompt tokens were recomputed
    # (pipeserve/prompt_cache/explain.py)
    cache_miss: dict[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def key_ids(self) -> list[int]:
        """The prompt as the prompt cache and checkpoints key it: the prompt ids, each image
        token named by its image's digest (pipeserve/vision/rows.py), position for position."""
        return self.prompt_ids if self.media is None else self.media.key_ids(self.prompt_ids)
