"""Stage contracts: each slot of the pipeline is a callable from typed inputs to typed
outputs (pipeserve/core/plan.py), and StageDeps is what step stages are built with. Request stages
run on the event loop; step stages run on the engine thread."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pipeserve.core.plan import Drafts, Logits, LookupResult, Sampled, StepOutput, StepPlan
from pipeserve.request import Request

if TYPE_CHECKING:
    from pipeserve.core.rows import RowStore
    from pipeserve.config import ServeConfig
    from pipeserve.model.loader import LoadedModel
    from pipeserve.metrics import Metrics
    from pipeserve.prompt_cache.ram import PromptCache
    from pipeserve.core.sampler_states import SamplerStates


class RequestStage(Protocol):
    """Event loop, once per request; never imports mlx.
    Returns the request, enriched, or raises InvalidRequest / AdmissionRejected."""

    async def __call__(self, request: Request) -> Request: ...


class CacheLookup(Protocol):
    """Engine thread, at admission: the longest reusable prefix (or a checkpoint to resume),
    the checkpoint positions the row still needs and why tokens are recomputed, as one
    LookupResult; the scheduler applies it to the row. Never mutates the request."""

    def __call__(self, request: Request) -> LookupResult: ...


class Draft(Protocol):
    """Engine thread, before the forward: proposed tokens per decoding row (at most the
    row's `max_drafts`). `settle` hears what the step kept (draft=mtp learns from the
    target's hidden states; draft=model trims its own KV)."""

    def __call__(self, plan: StepPlan, kv: RowStore) -> Drafts: ...

    def settle(self, plan: StepPlan, logits: Logits, output: StepOutput | None) -> None: ...

    def release(self, request_id: str) -> None: ...


class Prefill(Protocol):
    """Engine thread. The model forward over this step's planned tokens — prompt chunks,
    decode tokens and drafts — returning the logits of the rows that sample (lazy)."""

    def __call__(self, plan: StepPlan, kv: RowStore) -> Logits: ...


class Sample(Protocol):
    """Engine thread. One token per sampling row (lazy arrays); a row whose own settings
    fail is reported in `Sampled.failed`, the others' tokens do not depend on it. With
    drafts, verify calls it once per drafted position with the logits there (a grammar row's
    matcher standing after the drafts before it): picks at positions past a rejected draft
    are discarded, so a stage keeping state per call sees those calls too."""

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled: ...


class Verify(Protocol):
    """Engine thread; built as `Cls(cfg, deps, sample)` with the step's sample stage. Accept
    the longest prefix of each row's drafts the target agrees with (lossless: the sample
    stage's own picks), plus the target's own next token; host results. Rolls the row store
    back to what was kept (`kv.rollback`); the step then sets each row's next input."""

    def __call__(self, logits: Logits, plan: StepPlan, rows: Sequence[Request],
                 kv: RowStore) -> StepOutput: ...


class Ledger(Protocol):
    """The scheduler's in-flight view (pipeserve/core/scheduler.py): a row's tokens and decode
    steps planned but not yet applied (their KV exists, their counters have not moved)."""

    def tokens_ahead(self, request_id: str) -> int: ...

    def outputs_ahead(self, request_id: str) -> int: ...


class Persist(Protocol):
    """Engine thread: put reusable KV into the prompt cache — `prompts` right after the
    forward (prompts whose prefill finished in it; their copies may wait for `drain`, between
    steps, up to `rows` of them a call); `__call__` after a step is applied
    (finished rows' prompt + output before their KV is freed, due checkpoints)."""

    def prompts(self, plan: StepPlan, kv: RowStore) -> None: ...

    def drain(self, kv: RowStore, rows: int) -> None: ...

    def waiting(self, rid: str) -> bool: ...

    def __call__(self, finished: Sequence[Request], running: Sequence[Request],
                 kv: RowStore) -> None: ...


@dataclass(frozen=True)
class StageDeps:
    """What step stages are built with, on the engine thread after the model loads. Read-only:
    no stage publishes anything here for another, and nothing is set on a stage after it is
    built. `samplers` is the one owner of the rows' sampling state, built by the step: the
    sample stage makes and advances a row's state there, persist reads a checkpoint's key.
    `ledger` is the scheduler's in-flight view (persist: the KV a row holds beyond its
    counters)."""

    cfg: ServeConfig
    loaded: LoadedModel
    metrics: Metrics
    layout: Any                # pipeserve.kv.layouts.DenseLayout (or another layout)
    prompt_cache: PromptCache | None = None   # None: cache=off
    samplers: SamplerStates | None = None   # every row's sampling state (sample, persist)
    ledger: Ledger | None = None            # None: nothing is ever planned ahead

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def keep_hidden(self) -> bool:
        """Forwards also return the trunk's hidden states (a proposer drafts from them: the
        draft option's own schema says so)."""
        return self.cfg.draft.keep_hidden
