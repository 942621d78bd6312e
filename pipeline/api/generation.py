"""Generation: one submitted request seen from the event loop. Token events become text (stop
strings cut), then pass the per-request output chain (reasoning splitter → tool-call parser)
and come out as protocol-neutral Deltas, with finish reason and usage. Event loop."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pipeline.api.reasoning import ReasoningSplitter, ThinkMarkers
from pipeline.api.record import Record
from pipeline.api.tool_formats import ToolFormat
from pipeline.api.tools import ToolCall, ToolCallParser
from pipeline.events import Failed, Finished, TokenDelta
from pipeline.request import FinishReason, Request, TokenLogprob
from pipeline.stream import RequestStream


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0   # output tokens decoded while inside a think span
    speculation: dict[str, int] | None = None   # {proposed, accepted} draft tokens (draft≠none)
    record: dict[str, Any] | None = None   # the reproducibility record, once the output ended


@dataclass(slots=True)
class Delta:
    """A slice of output. Empty (falsy) deltas are keep-alive ticks for streaming callers.
    Every decoded token yields a delta (`tokens` > 0) even when its text is held back (an
    incomplete character, a possible stop string): OpenAI streams then send one chunk per
    token, as mlx_lm.server does, so clients see per-token timing."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.tokens or self.content or self.reasoning or self.tool_calls
                    or self.logprobs)

    def extend(self, other: Delta) -> Delta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


class OutputChain:
    """Text → Delta through the request's parsers, in order: reasoning, then tool calls.
    `prefix` is assistant text the prompt already holds; it sets the parsers' state."""

    def __init__(self, splitter: ReasoningSplitter | None, tools: ToolCallParser | None,
                 prefix: str = "") -> None:
        self.splitter, self.tools = splitter, tools
        if prefix:
            self.feed(prefix)   # markup only: what it would emit is the prompt's, not output

    @classmethod
    def for_request(cls, request: Request, think: ThinkMarkers | None,
                    fmt: ToolFormat | None) -> OutputChain:
        inputs = request.inputs
        tools = None
        # a constrained output (structured output) is the answer itself, never a tool call
        if (fmt is not None and inputs.tools and inputs.tool_choice != "none"
                and request.constraint is None):
            tools = ToolCallParser(fmt, inputs.tools, request.request_id)
        splitter = ReasoningSplitter(think) if think is not None else None
        return cls(splitter, tools, request.output_prefix)

    @property
    def in_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.in_reasoning

    def feed(self, text: str) -> Delta:
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        return self._content(Delta(reasoning=reasoning), content, final=False)

    def finish(self) -> Delta:
        reasoning, content = self.splitter.finish() if self.splitter else ("", "")
        return self._content(Delta(reasoning=reasoning), content, final=True)

    def _content(self, delta: Delta, text: str, final: bool) -> Delta:
        if self.tools is None:
            delta.content = text
            return delta
        delta.content, delta.tool_calls = self.tools.feed(text)
        if final:
            tail, calls = self.tools.finish()
            delta.content += tail
            delta.tool_calls.extend(calls)
        return delta


class Generation:
    """Run one submitted request to its end: `deltas()` yields output as it is decoded; after
    it ends, `finish_reason` (stop | length | tool_calls | abort), `stop_sequence`, `usage`
    (with the reproducibility `record`), and the whole `content`, `reasoning` and `tool_calls`
    are set."""

    def __init__(self, app_ctx: Any, request: Request, stream: RequestStream,
                 parse_output: bool = True) -> None:
        self.app_ctx, self.request, self.stream = app_ctx, request, stream
        self.parse_output = parse_output
        self.finish_reason = "stop"
        self.stop_sequence: str | None = None
        self.usage = Usage(prompt_tokens=request.num_prompt_tokens)
        self.all_logprobs: list[TokenLogprob] = []
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.first_token_s: float | None = None   # perf_counter when the first token arrived
        self.batch_size_max = 0
        self.record: Record | None = None

    def _chain(self) -> OutputChain:
        if not self.parse_output:
            return OutputChain(None, None)
        tokenize = self.app_ctx.front.tokenize
        return OutputChain.for_request(self.request, getattr(tokenize, "think", None),
                                       getattr(tokenize, "tool_format", None))

    def _record(self, delta: Delta) -> Delta:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)
        return delta

    def _settle(self, reason: str, event: Finished | None = None) -> None:
        self.finish_reason = "tool_calls" if self.tool_calls else reason
        reported = event.extras.get("batch_size_max") if event is not None else None
        if isinstance(reported, int) and reported > 0:
            self.batch_size_max = reported   # the engine saw every step; better than our samples
        self.record = self.app_ctx.record.with_batch_size(self.batch_size_max or None)
        self.usage.record = self.record.body()

    def _observe_batch(self) -> None:
        """Rows running now (left the queue, not done), sampled as this request's tokens
        arrive. Approximate; a Finished event's extras["batch_size_max"] replaces it."""
        engine = self.app_ctx.engine
        rows = engine.num_inflight - engine.num_waiting
        rows = min(max(rows, 1), self.app_ctx.cfg.scheduler.max_batch)
        self.batch_size_max = max(self.batch_size_max, rows)

    async def deltas(self) -> AsyncIterator[Delta]:
        ctx, req = self.app_ctx, self.request
        text = ctx.front.detokenize.open(req.sampling.stop)
        chain = self._chain()
        keep_alive = ctx.cfg.server.keep_alive_s
        while True:
            try:
                event = await asyncio.wait_for(self.stream.next(), keep_alive)
            except asyncio.TimeoutError:
                yield Delta()   # lets a streaming caller send a keep-alive
                continue
            if isinstance(event, TokenDelta):
                n = len(event.token_ids)
                if self.first_token_s is None and n:
                    self.first_token_s = time.perf_counter()
                self._observe_batch()
                self.usage.completion_tokens += n
                self.usage.reasoning_tokens += n if chain.in_reasoning else 0
                self.all_logprobs.extend(event.logprobs or [])
                delta = chain.feed(text.feed(event.token_ids))
                delta.logprobs = event.logprobs
                delta.tokens = n
                if text.stopped:
                    ctx.engine.abort(req.request_id)
                    self.stop_sequence = text.matched_stop
                    delta = self._record(delta.extend(chain.finish()))
                    self._settle("stop")
                    yield delta
                    return
                yield self._record(delta)
            elif isinstance(event, Finished):
                self.usage.cached_tokens = event.num_cached_tokens
                spec = event.extras.get("speculation")
                if isinstance(spec, dict):
                    self.usage.speculation = dict(spec)
                tail = self._record(chain.feed(text.finish()).extend(chain.finish()))
                self._settle("length" if event.reason is FinishReason.LENGTH else "stop", event)
                if tail:
                    yield tail
                return
            else:
                assert isinstance(event, Failed)
                raise event.error

    async def run(self) -> None:
        """Consume the whole output (non-streaming callers)."""
        async for _ in self.deltas():
            pass
