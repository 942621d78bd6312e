"""Prompt scoring (echo with logprobs, lm-eval's loglikelihood): the logprob of every prompt
token given the tokens before it. `Score` is an engine command: the engine thread runs one
forward over the prompt between steps (in prefill_chunk pieces, on a fresh cache it drops
after) and replies; `score()` is its event-loop face. Engine thread (run) / event loop (score)."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pipeserve.core.client import reply_of
from pipeserve.core.events import answer
from pipeserve.errors import InvalidRequest, ServeError
from pipeserve.request import TokenLogprob

log = logging.getLogger(__name__)
WAIT_S = 600.0   # the most a handler waits for the engine to score one prompt
CHUNK = 512      # positions per forward: their float32 logits are held at once


@dataclass(slots=True)
class Score:
    """`token_ids` → `result`: None for the first token (nothing comes before it), then one
    TokenLogprob per token with its `top` likeliest alternatives; or `error`. `future` gets
    the result (or raises the error) once, on the engine thread or the pipe's reader."""

    token_ids: list[int]
    top: int
    future: Future[Any] = field(default_factory=Future)
    result: list[TokenLogprob | None] | None = None
    error: ServeError | None = None

    def run(self, engine: Any) -> None:
        try:
            if getattr(engine, "group", None) is not None:
                raise InvalidRequest("prompt logprobs (echo with logprobs) are not available "
                                     "with distributed=tensor/pipeline", param="echo")
            self.result = [None, *prompt_logprobs(engine.loaded.model, self.token_ids,
                                                  self.top, min(engine.cfg.scheduler.prefill_chunk, CHUNK))]
        except ServeError as e:
            self.error = e
        except Exception as e:  # the boundary: this request fails, the engine goes on
            log.exception("scoring a %d-token prompt failed", len(self.token_ids))
            self.error = ServeError(f"scoring the prompt failed ({type(e).__name__}); the "
                                    "server log has the details")
        answer(self.future, self.result, self.error)


def prompt_logprobs(model: Any, ids: list[int], top: int, chunk: int) -> list[TokenLogprob]:
    """Engine thread. log_softmax of the model's float32 logits at each position, read at the
    next prompt token (and its `top` best), over `ids[:-1]` in `chunk`-token pieces."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out: list[TokenLogprob] = []
    inputs = ids[:-1]
    for start in range(0, len(inputs), chunk):
        piece = inputs[start:start + chunk]
        targets = mx.array(ids[start + 1:start + 1 + len(piece)])
        logits = model(mx.array(piece, dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)
        lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lps, targets[:, None], axis=-1)[:, 0]
        parts = [chosen]
        if top:
            best = mx.argpartition(-lps, kth=top - 1, axis=-1)[:, :top]
            values_top = mx.take_along_axis(lps, best, axis=-1)
            order = mx.argsort(-values_top, axis=-1)   # best first
            parts += [mx.take_along_axis(best, order, axis=-1),
                      mx.take_along_axis(values_top, order, axis=-1)]
        mx.eval(parts + [c.state for c in cache])
        values = chosen.tolist()
        tops = (list(zip(parts[1].tolist(), parts[2].tolist())) if top
                else [([], [])] * len(piece))
        for j, (value, (tids, tvals)) in enumerate(zip(values, tops)):
            out.append(TokenLogprob(ids[start + 1 + j], float(value),
                                    list(zip(tids, tvals))))
    return out


async def score(engine: Any, token_ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Event loop: hand a Score to the engine (in-process or a pool member's process) and
    wait for its reply without holding an executor thread."""
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    return await reply_of(engine.command(Score(list(token_ids), top)), WAIT_S,
                          "score the prompt")
