"""Idle warm-up (cache.warmup_budget_tokens): after a chat turn ends and nothing else runs,
the next turn's likely prefix — the history with this answer, as the template renders it —
is prefilled into the prompt cache by a request of the lowest priority; any real request
cancels it at the next step boundary. Event loop (the engine thread runs the prefill)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from os.path import commonprefix   # of any two sequences, not only paths
from typing import Any

from pipeserve.http.api.generation import Generation
from pipeserve.core.events import Failed, Finished
from pipeserve.eventloop.offload import off_loop
from pipeserve.request import FinishReason, PromptInput, Request, SamplingParams
from pipeserve.core.stream import RequestStream

log = logging.getLogger("pipeserve")
WARMUP_PRIORITY = 10   # below every class (0..9): it never runs ahead of real work


class Warmup:
    def __init__(self, budget_tokens: int, metrics: Any) -> None:
        self.budget = budget_tokens
        self.metrics = metrics
        self.inflight: dict[str, Any] = {}   # warm-up request id → its engine
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def cancel_all(self) -> None:
        """Real work arrived: every warm-up stops at the next step boundary."""
        for rid, engine in list(self.inflight.items()):
            engine.abort(rid)

    def after_turn(self, ctx: Any, gen: Generation) -> None:
        """A chat turn ended well: warm its continuation once the engine is idle."""
        req = gen.request
        if (not self.enabled or req.inputs.messages is None or gen.tool_calls
                or gen.finish_reason not in ("stop", "length") or ctx.front is None):
            return
        task = asyncio.get_running_loop().create_task(self._warm(ctx, gen))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, ctx: Any, gen: Generation) -> None:
        req, front, engine = gen.request, ctx.front, ctx.engine
        inputs = replace(req.inputs, messages=[*req.inputs.messages,
                                               {"role": "assistant", "content": gen.content}])
        try:
            ids = await off_loop(len(gen.content) + req.num_prompt_tokens * 4, self._render,
                                 front, inputs)
        except Exception as e:  # noqa: BLE001 — a template that cannot render the answer back
            log.debug("warm-up skipped: %s", e)
            return
        shared = len(commonprefix([ids, req.prompt_ids]))
        cost = len(ids) - shared
        if cost <= 1 or cost > self.budget or engine.load().num_inflight > 0:
            return   # nothing new, over the budget, or not idle
        warm = Request(request_id=f"warm-{uuid.uuid4().hex}", endpoint="warmup",
                       inputs=PromptInput(token_ids=ids), prompt_ids=ids,
                       sampling=SamplingParams(max_tokens=1, temperature=0.0),
                       stop_token_ids=req.stop_token_ids, adapter=req.adapter,
                       priority=WARMUP_PRIORITY, priority_class="warmup")
        stream = RequestStream(asyncio.get_running_loop())
        self.inflight[warm.request_id] = engine
        engine.submit(warm, stream)
        try:
            while True:
                event = await stream.next()
                if isinstance(event, Finished):
                    done = event.reason is not FinishReason.ABORT
                    self.metrics.warmups.labels("done" if done else "cancelled").inc()
                    if done:
                        self.metrics.warmup_tokens.inc(cost)
                    return
                if isinstance(event, Failed):
                    self.metrics.warmups.labels("failed").inc()
                    return
        finally:
            self.inflight.pop(warm.request_id, None)

    @staticmethod
    def _render(front: Any, inputs: PromptInput) -> list[int]:
        text = front.tokenize.prompt.render_text(inputs, add_generation_prompt=False)
        return list(front.tokenize.encoder.encode_rendered(text))
