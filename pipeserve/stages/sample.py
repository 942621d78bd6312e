"""Sample: last-position logits → one token per sampling row, with per-row temperature,
top_p/top_k/min_p/XTC, penalties, logit_bias, structured-output masks, request-local seeds and
logprobs. A fault in one row's own work (its state, penalties, grammar, draw) fails that row
alone (`Sampled.failed`); the other rows' tokens do not depend on it. Engine thread."""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import mlx.core as mx
import numpy as np

from pipeserve.config import ServeConfig
from pipeserve.grammar.constraint import fill_bitmask
from pipeserve.grammar.rows import grammar_failed
from pipeserve.core.plan import Logits, Sampled
from pipeserve.request import Request
from pipeserve.core.sampler_states import RowSampling, SamplerStates
from pipeserve.core.sampling import sampling_logits
from pipeserve.core.stage import StageDeps


class Sample:
    """Rows that only need argmax share one op; rows with processors or temperature > 0 get
    their own (their PRNG streams are request-local, so a row's samples do not depend on
    which other rows share its batch). Each row's state (key, penalties, history) is kept in
    the SamplerStates the step hands in (`deps.samplers`), never on the request."""

    name: ClassVar[str] = "sample"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.eos_ids = sorted(deps.loaded.tokenizer.eos_token_ids)
        self.rows = deps.samplers if deps.samplers is not None else SamplerStates()
        self._bias_key: tuple[str, ...] = ()
        self._bias: tuple[mx.array, mx.array, mx.array] | None = None
        self._shifts = mx.arange(32, dtype=mx.int32)

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled:
        out = Sampled(logits.order, None)
        if not rows:
            return out
        reqs = list(rows)
        states = self.states(reqs, out.failed)
        x = self.apply_bias(logits.logits, reqs, states)
        if any(s.processors for s in states):
            x = mx.concatenate([self._process(out.failed, r, s, x[i:i + 1])
                                for i, (r, s) in enumerate(zip(reqs, states))], axis=0)
        if any(r.grammar is not None for r in reqs):
            x = self._constrain(out.failed, x, reqs)
            out.sync = True   # the next mask needs this step's token on the host
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if all(r.sampling.greedy for r in reqs):
            tokens = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        else:
            tokens = mx.concatenate([self._draw(out.failed, r, s, logprobs[i:i + 1])
                                     for i, (r, s) in enumerate(zip(reqs, states))])
        for i, state in enumerate(states):
            if state.history is not None:
                state.history = mx.concatenate([state.history, tokens[i:i + 1]])
        out.token_ids = tokens
        if any(r.sampling.logprobs for r in reqs):
            out.logprobs = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32),
                                              axis=-1)[:, 0]
            k = max(r.sampling.top_logprobs for r in reqs)
            if k:
                out.top_ids, out.top_logprobs = top_k(logprobs, k)
        return out

    def states(self, reqs: list[Request], failed: dict[str, BaseException]
               ) -> list[RowSampling]:
        """Each row's sampling state (made on its first step). A row whose own settings
        cannot be made fails; a neutral state stands in for it."""
        states = []
        for r in reqs:
            try:
                states.append(self.rows.of(r))
            except Exception as e:   # this row's settings: fail it, keep the others
                failed.setdefault(r.request_id, e)
                states.append(self.rows.of(r))   # the neutral stand-in the store kept
        return states

    def apply_bias(self, logits: mx.array, reqs: list[Request],
                    states: list[RowSampling]) -> mx.array:
        """Every row's logit_bias in one scatter-add; the index arrays are rebuilt only when
        the rows change."""
        key = tuple(r.request_id for r in reqs)
        if key != self._bias_key:
            rows, cols, vals = [], [], []
            for i, state in enumerate(states):
                rows += [i] * len(state.bias_ids)
                cols += state.bias_ids
                vals += state.bias_values
            self._bias_key = key
            if rows:   # padded to a power of two with +0.0 at (0, 0): one scatter kernel per
                pad = _bucket(len(rows)) - len(rows)   # size class, not one per entry count
                rows, cols, vals = rows + [0] * pad, cols + [0] * pad, vals + [0.0] * pad
            self._bias = ((mx.array(rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32),
                           mx.array(vals, dtype=mx.float32)) if rows else None)
        if self._bias is None:
            return logits
        rows_idx, cols_idx, vals = self._bias
        return logits.at[rows_idx, cols_idx].add(vals.astype(logits.dtype))

    def _constrain(self, failed: dict[str, BaseException], logits: mx.array,
                   reqs: list[Request]) -> mx.array:
        """Constrained rows: tokens their grammar does not allow get -inf, from the matcher's
        state (the step advanced it to the output read back: sync; verify, past the drafts).
        Free rows get an all-ones mask, so their logits pass through unchanged. A matcher that
        fails (its grammar hit a parser limit, or nothing is allowed) fails its row."""
        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        host = np.full((rows, words), -1, dtype=np.int32)
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                try:
                    fill_bitmask([(i, req.grammar)], host)
                    if not host[i].any():
                        raise grammar_failed(req)
                except Exception as e:   # this row's grammar: fail it; its mask lets all through
                    failed.setdefault(req.request_id, e)
                    host[i] = -1
        bits = mx.right_shift(mx.array(host)[:, :, None], self._shifts) & 1
        allowed = bits.reshape(rows, words * 32)[:, :vocab].astype(mx.bool_)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    @staticmethod
    def _process(failed: dict[str, BaseException], req: Request, state: RowSampling,
                 logits: mx.array) -> mx.array:
        try:
            for proc in state.processors:
                logits = proc(state.history, logits)
        except Exception as e:   # this row's penalties: fail it, its logits pass through
            failed.setdefault(req.request_id, e)
        return logits

    def _draw(self, failed: dict[str, BaseException], req: Request, state: RowSampling,
              logprobs: mx.array) -> mx.array:
        sp = req.sampling
        if sp.greedy:
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        try:
            scaled = sampling_logits(logprobs, sp, self.eos_ids)
        except Exception as e:   # this row's settings: fail it; argmax stands in
            failed.setdefault(req.request_id, e)
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        state.prev_key = state.key
        state.key, sub = mx.random.split(state.key)
        return mx.random.categorical(scaled, key=sub).astype(mx.uint32)


def top_k(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k best ids and their logprobs along the last axis, best first."""
    top = mx.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def _bucket(n: int) -> int:
    """The size class of `n` scatter entries: the next power of two, at least 64."""
    return max(64, 1 << (n - 1).bit_length())
