"""Stage protocols, the per-step Batch and the EngineContext step stages are built with.
Request stages run on the event loop; step stages run on the engine thread."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pipeline.request import Request

if TYPE_CHECKING:
    from pipeline.config import ServeConfig
    from pipeline.loader import LoadedModel
    from pipeline.metrics import Metrics


class RequestStage(Protocol):
    """Event loop, once per request; never imports mlx.
    Returns the request, enriched, or raises InvalidRequest / AdmissionRejected."""

    async def __call__(self, request: Request) -> Request: ...


class StepStage(Protocol):
    """Engine thread, once per step; reads and writes named fields of `batch`.
    Must not block on results: leave arrays lazy, the engine evaluates them."""

    name: ClassVar[str]

    def __call__(self, batch: Batch) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine facts the request stages check against, fixed once the model is loaded (they
    never touch the model itself)."""

    max_context: int   # tokens of prompt + output: the model's, capped by admission.max_context
    vocab_size: int    # width of the model's logits: token ids are < this

    @classmethod
    def of(cls, cfg: ServeConfig, loaded: LoadedModel) -> EngineLimits:
        text = loaded.config.get("text_config") or {}
        vocab = int(loaded.config.get("vocab_size") or text.get("vocab_size")
                    or len(loaded.tokenizer))
        native = loaded.max_context
        return cls(min(cfg.admission.max_context or native, native), vocab)


@dataclass
class EngineContext:
    """What step stages are built with, on the engine thread after the model loads."""

    cfg: ServeConfig
    loaded: LoadedModel
    metrics: Metrics
    row_batch: Any = None   # the shared decode batch (pipeline.kv.batch.RowBatch), set by prefill
    prompt_cache: Any = None  # pipeline.prompt_cache.ram.RamPromptCache, or None (cache=off)
    layout: Any = None        # pipeline.kv.layouts.DenseLayout (or another layout): makes caches
    proposer: Any = None      # pipeline.draft.proposers.*, set by the draft stage (draft≠none)
    keep_hidden: bool = False  # set by draft=mtp: forwards also return the trunk's hidden states

    @property
    def model(self) -> Any:
        return self.loaded.model


@dataclass(slots=True)
class Batch:
    """One engine step. The scheduler fills the first two fields; each later field names
    the stage that sets it. Arrays stay lazy until the engine evaluates the step."""

    requests: list[Request]              # set by scheduler: rows of this step
    num_new_tokens: list[int]            # set by scheduler: tokens each row computes now
    sample_rows: list[int] = field(default_factory=list)  # set by prefill: rows that sample
    logits: Any = None                   # set by prefill: (len(sample_rows), vocab) last logits
    sampled_ids: Any = None              # set by sample: (len(sample_rows),) int32
    logprobs: Any = None                 # set by sample: chosen-token logprob per sample row
    top_ids: Any = None                  # set by sample: (rows, k) ids, when any row asks
    top_logprobs: Any = None             # set by sample: (rows, k) logprobs, when any row asks
    sync: bool = False                   # set by sample/verify: a row needs its token on the
                                         # host before the next step (structured output, drafts)
    drafts: dict[int, list[int]] | None = None  # set by draft: proposed tokens per row index
    width: int = 1                       # set by prefill: positions per sample row in `logits`
                                         # (1 + longest draft; logits is 3-D when > 1)
    snapshot: Any = None                 # set by prefill: recurrent state before a verify forward
    hidden: Any = None                   # set by prefill (draft=mtp): (rows, width, hidden) of
                                         # the decode forward, in sample_rows order
    target_logprobs: Any = None          # set by sample (width > 1): (rows, width, vocab)
    target_probs: Any = None             # set by sample (width > 1): {sample row i: (width,
                                         # vocab) sampling distribution} for rows with T > 0
    emitted: list[list[int]] | None = None        # set by verify: host tokens per sample row
    emitted_logprobs: list[list[float]] | None = None  # set by verify, when rows ask
    emitted_top: list[list[list[tuple[int, float]]]] | None = None  # set by verify
    failed: dict[int, BaseException] = field(default_factory=dict)  # set by draft/sample/
                                         # verify: row index → why that row alone failed; its
                                         # entries in the outputs are placeholders, and the
                                         # engine fails just those requests

    @property
    def size(self) -> int:
        return len(self.requests)

    def outputs(self) -> list[Any]:
        """Arrays the engine evaluates at the end of the step."""
        if self.emitted is not None:
            return []
        return [a for a in (self.sampled_ids, self.logprobs, self.top_ids, self.top_logprobs)
                if a is not None]
