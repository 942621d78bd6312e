"""The `scheduler` and `sampling` groups' schemas: who runs in a step and the server-wide sampling
defaults. Imports no mlx: checked at launch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeserve.errors import ConfigError, check_positive as _positive


@dataclass
class SchedulerConfig:
    _target_: str = "pipeserve.core.scheduler.Scheduler"
    # rows running together; a cap, not a minimum (unset: fits the device — 8 on a CPU,
    # 256 on a GPU)
    max_batch: Optional[int] = None
    # tokens one step computes over all its rows: decode tokens, drafts and prompt chunks
    # (unset: 2048 on a CPU, 16384 on a GPU); at least max_batch
    max_num_batched_tokens: Optional[int] = None
    prefill_chunk: int = 2048   # most prompt tokens one request computes in a step
    # hand a step to the device after the previous step's tokens are applied and posted to the
    # streams, not before: the event loop then writes them while this thread waits in
    # mx.async_eval (which releases the GIL) instead of competing with its Python for it. On
    # MLX's CUDA backend async_eval returns about when the device is done, so this thread's
    # Python outside it is device idle time, and the event loop's would add to it. Unset: on a
    # GPU (measured there, docs/notes round 30); off on a CPU, whose device idles while it waits
    dispatch_late: Optional[bool] = None
    # seconds a waiting request may be overtaken by more urgent `priority` ones; past it, it
    # goes first (bounded starvation); None: strict priority
    max_wait_s: Optional[float] = 30.0
    # before reporting ready, run a few requests of the server's own (a two-chunk prompt, a
    # burst under every sampling path) so the first users do not wait while MLX builds its
    # kernels; unset: on a GPU (a CPU builds them in milliseconds)
    kernel_warmup: Optional[bool] = None
    # an idle engine that wakes to a request keeps taking arrivals (a client opening a
    # connection counts) until none came for this long (at most arrival_window_ms), so a
    # burst is prefilled together rather than split over two steps, the first group's first
    # tokens waiting for the second's chunk; unset: 5 on a GPU, 0 (off) on a CPU. Only an
    # idle engine waits: a running batch never does.
    # The window covers a burst of 128 reaching the engine (the client's writes, the reads)
    arrival_gap_ms: Optional[float] = None
    arrival_window_ms: float = 50.0
    # log one line per engine step (pipeserve.steps, INFO): its wall clock and each part's
    # milliseconds (inbox, schedule, launch, apply, drain), to line a burst's steps up with its
    # request lines (core/step_trace.py); a diagnostic, off by default
    step_trace: bool = False

    def late_dispatch(self, on_gpu: bool) -> bool:
        """Whether the engine hands a step to the device only after posting the previous one's
        tokens (scheduler.dispatch_late; unset: on a GPU)."""
        return on_gpu if self.dispatch_late is None else self.dispatch_late

    def arrival_gap_s(self, device: str) -> float:
        """The gap an idle engine on `device` (its name, e.g. "Device(gpu, 0)") waits for."""
        gap_ms = self.arrival_gap_ms if self.arrival_gap_ms is not None else (
            5.0 if "gpu" in device else 0.0)
        return gap_ms / 1000

    def __post_init__(self) -> None:
        for key in ("arrival_gap_ms", "arrival_window_ms"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise ConfigError(f"scheduler.{key} must be >= 0 (milliseconds), got {value}")
        _positive("scheduler.max_batch", self.max_batch)
        _positive("scheduler.max_wait_s", self.max_wait_s)
        _positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("scheduler.prefill_chunk", self.prefill_chunk, allow_none=False)
        if (self.max_batch is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_batch):
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least scheduler.max_batch ({self.max_batch}): every decoding row needs one "
                "token per step")


@dataclass
class SerialSchedulerConfig(SchedulerConfig):
    """One request at a time: the continuous scheduler with one row, whose lone row decodes
    with plain caches (arrival-independent numerics, mlx-lm's arithmetic)."""

    max_batch: Optional[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch != 1:
            raise ConfigError(
                f"scheduler.max_batch must be 1 with scheduler=serial, got {self.max_batch}")


@dataclass
class ContinuousSchedulerConfig(SchedulerConfig):
    pass


@dataclass
class SamplingConfig:
    """Server-wide sampling defaults; unset fields fall back to generation_config.json."""

    temperature: Optional[float] = None   # used when a request sets none; 0 is greedy
    top_p: Optional[float] = None         # nucleus sampling, (0, 1]
    top_k: Optional[int] = None           # keep the k most likely tokens; 0 is off
    min_p: Optional[float] = None         # drop tokens below min_p x the top probability
    repetition_penalty: Optional[float] = None   # > 1 discourages repeated tokens
    presence_penalty: Optional[float] = None     # OpenAI's: subtracted once per seen token
    frequency_penalty: Optional[float] = None    # OpenAI's: subtracted per occurrence
    penalty_context_size: int = 20   # tokens of history the penalties look at

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.min_p
        if t is not None and not 0 <= t <= 2:
            raise ConfigError(f"sampling.temperature must be in [0, 2], got {t}")
        if p is not None and not 0 < p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {p}")
        if m is not None and not 0 <= m <= 1:
            raise ConfigError(f"sampling.min_p must be in [0, 1], got {m}")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0, got {self.top_k}")
        _positive("sampling.repetition_penalty", self.repetition_penalty)
        _positive("sampling.penalty_context_size", self.penalty_context_size, allow_none=False)
