"""Kernel warm-up at launch (scheduler.kernel_warmup): before the engine reports ready it runs a few requests of
its own that meet the kernels a server meets first — a prompt of two chunks and a tail, and a
burst of short prompts decoding together under every sampling path (greedy, temperature with
top-p / top-k / min-p / XTC, penalties, logit_bias, logprobs, a seed) — so the first users do
not wait while MLX builds them. They go through the real scheduler and step with the prompt
cache detached and the metrics muted: no cache entry and no metric comes of them."""
from __future__ import annotations

import random
from typing import Any

from pipeserve.core.events import Event, Failed, Finished
from pipeserve.core.stream import RequestStream
from pipeserve.request import PromptInput, Request, SamplingParams

BURST_ROWS = 32       # rows of the burst, at most (scheduler.max_batch caps it)
BURST_PROMPT = 48     # tokens of each burst prompt
BURST_OUTPUT = 4      # tokens each burst row decodes
LONG_TAIL = 17        # the long prompt's tokens past its last full chunk

# One per burst row, in turn: each sampling path builds its own kernels.
SAMPLINGS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 40},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.5,
     "frequency_penalty": 0.5},
    {"temperature": 0.0, "logit_bias": {}},   # filled with token ids below
    {"temperature": 0.0, "logprobs": True, "top_logprobs": 5},
    {"temperature": 0.9, "seed": 7},
    {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.1},
)


class _Inline:
    """Stands in for an event loop: a warm-up row's events are delivered on the engine thread
    at once (post_many hands each loop its batch through call_soon_threadsafe)."""

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)


class Sink(RequestStream):
    """A request stream nobody reads (a kernel warm-up row's): it keeps only whether the row ended, and how."""

    def __init__(self) -> None:
        super().__init__(_Inline())   # type: ignore[arg-type]   # see _Inline
        self.error: BaseException | None = None

    def _put(self, event: Event) -> None:
        if isinstance(event, (Finished, Failed)):
            self.finished = True
            if isinstance(event, Failed):
                self.error = event.error


def requests(vocab: int, max_context: int, prefill_chunk: int, max_rows: int,
             seed: int = 0) -> list[Request]:
    """The kernel warm-up's requests: one long prompt (two chunks and a tail, as far as the context allows),
    then a burst of short prompts cycling through SAMPLINGS. Random ids, no stop tokens, so
    every row runs to its max_tokens."""
    rng = random.Random(seed)
    low, high = min(3, vocab - 1), max(min(vocab, 50_000), 4)

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    out = []
    long_n = min(2 * prefill_chunk + LONG_TAIL, max_context - 4)
    if long_n > BURST_PROMPT:
        out.append(_request("kernel-warmup-long", ids(long_n), SamplingParams(temperature=0.0,
                                                                        max_tokens=2)))
    for i in range(max(1, min(BURST_ROWS, max_rows))):
        fields = dict(SAMPLINGS[i % len(SAMPLINGS)])
        if "logit_bias" in fields:
            fields["logit_bias"] = {t: (5.0 if k % 2 else -100.0)
                                    for k, t in enumerate(ids(3))}
        sp = SamplingParams(max_tokens=BURST_OUTPUT, **fields)
        out.append(_request(f"kernel-warmup-{i}", ids(min(BURST_PROMPT, max_context - 8)), sp))
    return out


def _request(rid: str, ids: list[int], sampling: SamplingParams) -> Request:
    return Request(request_id=rid, endpoint="kernel_warmup", inputs=PromptInput(token_ids=ids),
                   prompt_ids=list(ids), sampling=sampling, stop_token_ids=frozenset())


def enabled(cfg: Any, on_gpu: bool) -> bool:
    """scheduler.kernel_warmup, unset: on a GPU (kernel builds cost seconds there; a CPU's cost
    little, and a test suite launches many servers). Never in a distributed group: every rank
    runs rank 0's plans, and rank 0 alone would run these."""
    if cfg.distributed.enabled:
        return False
    return on_gpu if cfg.scheduler.kernel_warmup is None else bool(cfg.scheduler.kernel_warmup)

