"""Front: the request stages (tokenize, admission, detokenize) of one served model, built on
the event loop's side once its engine has loaded the model, and the model's output markup.
The server builds one per model (pipeserve/http/startup.py), the model pool one per member
(pipeserve/pool/pool.py). Event loop; never touches MLX."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pipeserve.config import ServeConfig, build
from pipeserve.http.api.volatile import VolatileSpans
from pipeserve.markup.output import OutputMarkup
from pipeserve.metrics import Metrics
from pipeserve.request import Request

if TYPE_CHECKING:
    from pipeserve.core.client import EngineClient

log = logging.getLogger("pipeserve")


class Front:
    """The request stages, built once the model (and so the tokenizer) is loaded, and the
    model's output markup, inferred here once and handed to tokenize, detokenize and the
    output path (pipeserve/http/api/generation.py reads `front.markup`)."""

    def __init__(self, cfg: ServeConfig, engine: EngineClient, metrics: Metrics) -> None:
        limits = engine.limits
        assert limits is not None
        loaded = limits.model
        self.markup = OutputMarkup.infer(loaded.tokenizer, cfg.model.tool_call_format.value,
                                         cfg.model.reasoning_format.value)
        log.info("output markup: %s", self.markup.describe())
        self.tokenize = build(cfg.pipeline.tokenize._target_, cfg, loaded, self.markup)
        if limits.rewinds and getattr(self.tokenize, "session_checkpoints", False):
            # the engine (in its own process, weights not here) says the model's cache cuts
            # back to any prefix: no chat needs its history's end rendered a second time
            self.tokenize.session_checkpoints = False
        self.admission = build(cfg.admission._target_, cfg, limits, engine.load, metrics)
        self.detokenize = build(cfg.pipeline.detokenize._target_, cfg, loaded, self.markup)
        self.volatile = VolatileSpans(cfg.server.volatile_spans)
        self.metrics = metrics

    def normalise(self, request: Request) -> Request:
        """Remove the volatile spans from the chat (before tokenize: the prompt cache keys
        the text without them) and count each kind removed."""
        request.volatile = self.volatile.strip(request.inputs)
        for name in request.volatile:
            self.metrics.volatile_spans.labels(name).inc()
        return request

    async def prepare(self, request: Request) -> Request:
        request = await self.tokenize(self.normalise(request))
        return await self.admission(request)

    def token_info(self, token_id: int) -> tuple[str, bytes]:
        raw = self.detokenize.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw
