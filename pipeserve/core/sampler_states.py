"""The sampler's per-row state and its one owner. A RowSampling is what one request's sampling
carries from step to step: its request-local PRNG key, the penalty processors and the history
they read, its logit_bias. SamplerStates holds every row's, by request id: made on the row's
first sampled step (from the key a checkpoint resume supplied, else its seed), advanced by the
sample stage (verify picks through it), read for a checkpoint's key, dropped when the row is
released. pipeserve/core/step.py builds the one store and hands it to the stages
(StageDeps.samplers); persist reads only `checkpoint_key`. Nothing of it lives on the Request.
Engine thread."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from pipeserve.request import Request

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(slots=True)
class RowSampling:
    """One request's sampling state, kept in SamplerStates across steps."""

    key: mx.array                 # request-local PRNG key, split every step
    processors: list[Processor]   # history-dependent penalties
    history: mx.array | None      # prompt + output ids, when a processor needs them
    bias_ids: list[int]           # logit_bias, applied for all rows in one scatter-add
    bias_values: list[float]
    prev_key: mx.array | None = None   # the key before the latest split (for checkpoints)

    @classmethod
    def neutral(cls) -> RowSampling:
        """What stands in for a row whose own settings could not be made (it is failed)."""
        return cls(key=mx.random.key(0), processors=[], history=None, bias_ids=[],
                   bias_values=[])

    @classmethod
    def new(cls, req: Request, key: list[int] | None = None) -> RowSampling:
        """A row's state at its first sampled step: `key` continues a checkpoint's stream,
        else the request's seed (a random one when it has none) starts it."""
        sp = req.sampling
        processors = make_logits_processors(
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
            repetition_context_size=sp.penalty_context_size,
            presence_penalty=sp.presence_penalty or None,
            presence_context_size=sp.penalty_context_size,
            frequency_penalty=sp.frequency_penalty or None,
            frequency_context_size=sp.penalty_context_size)
        seed = sp.seed if sp.seed is not None else random.getrandbits(63)
        prng = mx.array(key, dtype=mx.uint32) if key is not None else mx.random.key(seed)
        history = (mx.array(req.prompt_ids + req.output_ids, dtype=mx.uint32) if processors
                   else None)
        return cls(key=prng, processors=processors, history=history,
                   bias_ids=list(sp.logit_bias), bias_values=list(sp.logit_bias.values()))


class SamplerStates:
    """Every row's RowSampling, by request id (the only place it is kept)."""

    def __init__(self) -> None:
        self._rows: dict[str, RowSampling] = {}
        self._resume: dict[str, list[int]] = {}   # checkpoint keys of rows not sampled yet

    def __len__(self) -> int:
        return len(self._rows)

    def resume(self, request_id: str, key: list[int]) -> None:
        """A checkpoint resume (the CacheHit's key): the row's stream continues from `key`."""
        self._resume[request_id] = key

    def of(self, req: Request) -> RowSampling:
        """The row's state, made on its first call. When the row's own settings cannot be made
        this raises (the caller fails the row) and keeps a neutral state for its later calls."""
        state = self._rows.get(req.request_id)
        if state is None:
            try:
                state = RowSampling.new(req, self._resume.pop(req.request_id, None))
            except Exception:
                self._rows[req.request_id] = RowSampling.neutral()
                raise
            self._rows[req.request_id] = state
        return state

    def checkpoint_key(self, request_id: str, ahead: bool) -> list[int] | None:
        """The key the row's next unseen token is sampled with, for a checkpoint: the key
        before the latest split when a sampled step is `ahead` of the applied output (its
        token is not in the checkpoint). A resumed row not sampled yet keeps its resume key; a
        row never sampled has none."""
        state = self._rows.get(request_id)
        if state is None:
            return self._resume.get(request_id)
        key = state.prev_key if ahead and state.prev_key is not None else state.key
        return key.tolist()

    def mark(self, request_id: str) -> RowSampling | None:
        """A copy of the row's state as it is now (verify: after its pick at one position)."""
        state = self._rows.get(request_id)
        return replace(state) if state is not None else None

    def rewind(self, request_id: str, mark: RowSampling | None) -> None:
        """Back to `mark`: verify keeps the picks up to that position, so the row's stream
        goes on exactly as if it had sampled only those (seeded output equals draft=none's)."""
        if mark is not None:
            self._rows[request_id] = mark

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._resume.pop(request_id, None)
