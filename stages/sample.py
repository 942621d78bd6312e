"""Sample: last-position logits → one token per sampling row, with per-row temperature,
top_p/top_k/min_p/XTC, penalties, logit_bias, request-local seeds and logprobs. Engine thread."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import mlx.core as mx
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, apply_xtc,
                                 make_logits_processors)

from pipeline.config import ServeConfig
from pipeline.request import Request, SamplingParams
from pipeline.stage import Batch, EngineContext

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(slots=True)
class RowSampling:
    """Per-request sampling state, kept on `Request.row_state` across steps."""

    key: mx.array                 # request-local PRNG key, split every step
    processors: list[Processor]
    history: mx.array | None      # prompt + output ids, when a penalty needs them


class Sample:
    name: ClassVar[str] = "sample"

    def __init__(self, cfg: ServeConfig, ctx: EngineContext) -> None:
        self.eos_ids = sorted(ctx.loaded.tokenizer.eos_token_ids)

    def __call__(self, batch: Batch) -> None:
        if not batch.sample_rows:
            return
        tokens: list[mx.array] = []
        chosen: list[mx.array] = []
        tops: list[tuple[mx.array, mx.array]] = []
        want_logprobs = any(batch.requests[r].sampling.logprobs for r in batch.sample_rows)
        k = max(batch.requests[r].sampling.top_logprobs for r in batch.sample_rows)
        for i, row in enumerate(batch.sample_rows):
            req = batch.requests[row]
            token, logprobs = self._sample_row(req, batch.logits[i: i + 1])
            req.next_input = token
            tokens.append(token)
            if want_logprobs:
                chosen.append(logprobs[0, token[0]][None])
                if k:
                    top = mx.argpartition(-logprobs[0], k - 1)[:k]
                    vals = logprobs[0, top]
                    order = mx.argsort(-vals)
                    tops.append((top[order], vals[order]))
        batch.sampled_ids = tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)
        if want_logprobs:
            batch.logprobs = mx.concatenate(chosen)
            if k:
                batch.top_ids = mx.stack([t for t, _ in tops])
                batch.top_logprobs = mx.stack([v for _, v in tops])

    def _sample_row(self, req: Request, logits: mx.array) -> tuple[mx.array, mx.array]:
        sp = req.sampling
        state = req.row_state
        if state is None:
            state = req.row_state = self._init_state(req)
        if state.processors:
            for proc in state.processors:
                logits = proc(state.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if sp.greedy:
            token = mx.argmax(logprobs, axis=-1)
        else:
            state.key, sub = mx.random.split(state.key)
            token = mx.random.categorical(_filter(logprobs, sp, self.eos_ids) * (1 / sp.temperature),
                                          key=sub)
        token = token.astype(mx.uint32)
        if state.history is not None:
            state.history = mx.concatenate([state.history, token])
        return token, logprobs

    @staticmethod
    def _init_state(req: Request) -> RowSampling:
        sp = req.sampling
        processors = make_logits_processors(
            logit_bias=sp.logit_bias or None,
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
            repetition_context_size=sp.penalty_context_size,
            presence_penalty=sp.presence_penalty or None,
            presence_context_size=sp.penalty_context_size,
            frequency_penalty=sp.frequency_penalty or None,
            frequency_context_size=sp.penalty_context_size)
        seed = sp.seed if sp.seed is not None else random.getrandbits(63)
        history = mx.array(req.prompt_ids, dtype=mx.uint32) if sp.needs_history else None
        if processors and history is None:
            history = mx.array(req.prompt_ids, dtype=mx.uint32)
        return RowSampling(key=mx.random.key(seed), processors=processors, history=history)


def _filter(logprobs: mx.array, sp: SamplingParams, eos_ids: list[int]) -> Any:
    """mlx-lm's truncation order: top_p, min_p, XTC, top_k."""
    if 0 < sp.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sp.top_p)
    if sp.min_p > 0:
        logprobs = apply_min_p(logprobs, sp.min_p)
    if sp.xtc_probability > 0:
        logprobs = apply_xtc(logprobs, sp.xtc_probability, sp.xtc_threshold, eos_ids)
    if sp.top_k > 0:
        logprobs = apply_top_k(logprobs, sp.top_k)
    return logprobs
