"""Generation: one submitted request seen from the event loop. Token events become text (stop
strings cut), then pass the per-request output chain (reasoning splitter → tool-call parser)
and come out as protocol-neutral Deltas, with finish reason and usage. Event loop."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pipeserve.http.api.harmony import HarmonySplitter
from pipeserve.http.api.reasoning import ReasoningSplitter
from pipeserve.http.api.record import Record
from pipeserve.http.api.tools import ToolCall, ToolCallParser
from pipeserve.core.events import Failed, Finished, TokenDelta
from pipeserve.markup.output import OutputMarkup
from pipeserve.request import FinishReason, Request, TokenLogprob
from pipeserve.core.stream import RequestStream
from pipeserve.errors import ServeError

log = logging.getLogger("pipeserve")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0   # output tokens decoded while inside a think span
    speculation: dict[str, int] | None = None   # {proposed, accepted} draft tokens (draft≠none)
    record: dict[str, Any] | None = None   # the reproducibility record, once the output ended
    cache_miss: dict[str, Any] | None = None   # why prompt tokens were recomputed (cache_lookup)
    incomplete_call: bool = False   # a tool call cut by max_tokens was dropped from the output
    max_tokens_clamped: int | None = None   # the max_tokens in force when the one asked was cut

    @classmethod
    def total(cls, usages: list[Usage]) -> Usage:
        """The usage of n choices of one prompt: the prompt (and what the cache held of it
        for the first choice) once, the output tokens of all, the first choice's record."""
        first = usages[0]
        out = cls(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                  completion_tokens=sum(u.completion_tokens for u in usages),
                  reasoning_tokens=sum(u.reasoning_tokens for u in usages), record=first.record,
                  cache_miss=first.cache_miss,
                  incomplete_call=any(u.incomplete_call for u in usages),
                  max_tokens_clamped=first.max_tokens_clamped)
        specs = [u.speculation for u in usages if u.speculation is not None]
        if specs:
            out.speculation = {k: sum(s.get(k, 0) for s in specs) for k in specs[0]}
        return out


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


class Pieces:
    """Text appended piece by piece and joined when read: adding to a str copies all of it,
    so a response kept as one str costs more per token the longer it gets."""

    __slots__ = ("_pieces",)

    def __init__(self, text: str = "") -> None:
        self._pieces = [text] if text else []

    def add(self, text: str) -> None:
        if text:
            self._pieces.append(text)

    def text(self) -> str:
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]   # joined once; later reads and adds build on it
        return pieces[0] if pieces else ""


class OutputChain:
    """Text → Delta through the request's parsers, in order: reasoning, then tool calls.
    `prefix` is assistant text the prompt already holds; it sets the parsers' state."""

    def __init__(self, splitter: ReasoningSplitter | HarmonySplitter | None,
                 tools: ToolCallParser | None,
                 prefix: str = "") -> None:
        self.splitter, self.tools = splitter, tools
        if prefix:
            self.feed(prefix)   # markup only: what it would emit is the prompt's, not output

    @classmethod
    def for_request(cls, request: Request, markup: OutputMarkup) -> OutputChain:
        inputs, fmt, think = request.inputs, markup.tool_format, markup.think
        tools = None
        # a constrained output (structured output) is the answer itself, never a tool call;
        # a tool grammar's output is the call
        constraint = request.constraint
        if (fmt is not None and inputs.tools and inputs.tool_choice != "none"
                and (constraint is None or constraint.whole_turn)):
            tools = ToolCallParser(fmt, inputs.tools, request.request_id,
                                   max_calls=None if inputs.parallel_tool_calls else 1)
        # with tools, a call's start marker also ends a think span (a call written inside an
        # unclosed span is still a call)
        calls = fmt.starts if tools is not None and fmt is not None else ()
        splitter: ReasoningSplitter | HarmonySplitter | None = (
            HarmonySplitter() if markup.channels else
            ReasoningSplitter(think, calls) if think is not None else None)
        return cls(splitter, tools, request.output_prefix)

    @property
    def in_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.in_reasoning

    def feed(self, text: str) -> Delta:
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        return self._content(Delta(reasoning=reasoning), content, final=False)

    def finish(self, cut: bool = False) -> Delta:
        """The rest of the output; `cut`: it ended at max_tokens (an open call is dropped)."""
        reasoning, content = self.splitter.finish() if self.splitter else ("", "")
        return self._content(Delta(reasoning=reasoning), content, final=True, cut=cut)

    @property
    def dropped_cut(self) -> bool:
        """A tool call cut by max_tokens was dropped."""
        return self.tools is not None and self.tools.dropped_cut

    def _content(self, delta: Delta, text: str, final: bool, cut: bool = False) -> Delta:
        if self.tools is None:
            delta.content = text
            return delta
        delta.content, delta.tool_calls = self.tools.feed(text)
        if final:
            tail, calls = self.tools.finish(cut)
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
        asked = request.requested.max_tokens
        if isinstance(asked, int) and asked > request.sampling.max_tokens:
            self.usage.max_tokens_clamped = request.sampling.max_tokens
        self.all_logprobs: list[TokenLogprob] = []
        self._content, self._reasoning = Pieces(), Pieces()
        self.tool_calls: list[ToolCall] = []
        # the output in the order it came: ("reasoning" | "text", run) and ("call", call)
        self._parts: list[tuple[str, Pieces | ToolCall]] = []
        self.first_token_s: float | None = None   # perf_counter when the first token arrived
        self.batch_size_max = 0
        self.record: Record | None = None
        self.engine_extras: dict[str, object] = {}   # the Finished event's (queue wait, ...)
        self.ids: list[int] | None = None   # every output token id, when a caller keeps them
        self._resumed: list[int] = []   # output of an earlier run its prompt continues

    def resume(self, ids: list[int]) -> None:
        """The request's prompt ends with `ids`, output an earlier run of it generated (a
        background response's checkpoint): they are output here, first, as if decoded now."""
        self._resumed = list(ids)
        self.usage.prompt_tokens -= len(ids)
        if self.ids is None:
            self.ids = []

    def _chain(self) -> OutputChain:
        if not self.parse_output:
            return OutputChain(None, None)
        return OutputChain.for_request(self.request, self.app_ctx.front.markup)

    @property
    def content(self) -> str:
        return self._content.text()

    @property
    def reasoning(self) -> str:
        return self._reasoning.text()

    @property
    def parts(self) -> list[tuple[str, str | ToolCall]]:
        """The output in the order it came: ("reasoning" | "text", text) runs, ("call", call)."""
        return [(kind, part.text() if isinstance(part, Pieces) else part)
                for kind, part in self._parts]

    def _record(self, delta: Delta) -> Delta:
        """Keep the delta for the whole response: appended, joined only where it is read."""
        self._content.add(delta.content)
        self._reasoning.add(delta.reasoning)
        self.tool_calls.extend(delta.tool_calls)
        parts = self._parts
        for kind, text in (("reasoning", delta.reasoning), ("text", delta.content)):
            if not text:
                continue
            last = parts[-1] if parts else None
            if last is not None and last[0] == kind and isinstance(last[1], Pieces):
                last[1].add(text)
            else:
                parts.append((kind, Pieces(text)))
        parts.extend(("call", call) for call in delta.tool_calls)
        return delta

    def _settle(self, reason: str, event: Finished | None = None) -> None:
        # calls end the turn; a turn cut by max_tokens says length, even after a whole call
        self.finish_reason = "tool_calls" if self.tool_calls and reason == "stop" else reason
        reported = event.extras.get("batch_size_max") if event is not None else None
        if isinstance(reported, int) and reported > 0:
            self.batch_size_max = reported   # every step this request ran, the last included
        adapters = self.app_ctx.engine.limits.adapters
        self.record = self.app_ctx.record.with_adapter(adapters, self.request.adapter) \
            .with_batch_size(self.batch_size_max or None).with_media(self.request.media)
        self.usage.record = self.record.body()
        if adapters is not None:
            label = adapters.name(self.request.adapter) or "none"
            metrics = self.app_ctx.metrics
            metrics.adapter_requests.labels(label).inc()
            metrics.adapter_tokens.labels(label).inc(self.usage.completion_tokens)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The output, delta by delta. A fault of the output path itself (not a ServeError) is
        logged once and raised as one, so every stream ends with its error event and [DONE]."""
        try:
            async for delta in self._deltas():
                yield delta
        except ServeError:
            raise
        except Exception as e:   # the output path's boundary, as the handler's is before it
            rid = self.request.request_id
            log.exception("output path failed for request %s", rid)
            raise ServeError(f"internal error (request {rid}); the server log has the "
                             "details") from e

    async def _deltas(self) -> AsyncIterator[Delta]:
        ctx, req = self.app_ctx, self.request
        text = ctx.front.detokenize.open(req.sampling.stop)
        chain = self._chain()
        keep_alive = ctx.cfg.server.keep_alive_s
        replay = TokenDelta(req.request_id, self._resumed)   # not timed: decoded before
        resumed = [replay] if self._resumed else []
        while True:
            event = resumed.pop() if resumed else self.stream.poll()
            if event is None:
                event = await self.stream.wait(keep_alive)
                if event is None:
                    yield Delta()   # lets a streaming caller send a keep-alive
                    continue
            if isinstance(event, TokenDelta):
                n = len(event.token_ids)
                if self.first_token_s is None and n and event is not replay:
                    self.first_token_s = time.perf_counter()
                if event.batch_size_max > self.batch_size_max:   # a stop string ends it early
                    self.batch_size_max = event.batch_size_max
                self.usage.completion_tokens += n
                if self.ids is not None:
                    self.ids.extend(event.token_ids)
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
                self.usage.cached_tokens = min(event.num_cached_tokens, self.usage.prompt_tokens)
                self.engine_extras = event.extras
                miss = event.extras.get("cache_miss")
                self.usage.cache_miss = miss if isinstance(miss, dict) else None
                spec = event.extras.get("speculation")
                if isinstance(spec, dict):
                    self.usage.speculation = dict(spec)
                cut = event.reason is FinishReason.LENGTH
                tail = self._record(chain.feed(text.finish()).extend(chain.finish(cut)))
                if chain.dropped_cut:
                    self.usage.incomplete_call = True
                    ctx.metrics.incomplete_calls.inc()
                self._settle("length" if cut else "stop", event)
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


class Choices:
    """The n generations of one request (`n` > 1), merged into one stream of (choice index,
    Delta). Choice 0 runs first; the others are submitted (`submit_rest`) once its first
    token is out — its prompt is then in the prompt cache, so their prefill is a cache hit
    and the rows share the prompt's KV. Each choice has its own sampling stream. `close()`
    (always, in a finally) stops the pumps; aborting unfinished rows is the caller's."""

    def __init__(self, first: Generation, submit_rest: Callable[[], list[Generation]],
                 wait_first: bool = True) -> None:
        self.gens = [first]
        self._wait_first = wait_first
        self._submit_rest: Callable[[], list[Generation]] | None = submit_rest
        self._queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = \
            asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def _pump(self, index: int, gen: Generation) -> None:
        async def run() -> None:
            try:
                async for delta in gen.deltas():
                    self._queue.put_nowait((index, delta, None))
            except Exception as e:   # noqa: BLE001 — re-raised by deltas() in the caller
                self._queue.put_nowait((index, None, e))
                return
            self._queue.put_nowait((index, None, None))
        self._tasks.append(asyncio.get_running_loop().create_task(run()))

    def _start_rest(self) -> None:
        submit, self._submit_rest = self._submit_rest, None
        if submit is not None:
            for gen in submit():
                self.gens.append(gen)
                self._pump(len(self.gens) - 1, gen)

    async def deltas(self) -> AsyncIterator[tuple[int, Delta | None]]:
        """(choice, delta) as they come; (choice, None) once that choice has ended."""
        self._pump(0, self.gens[0])
        if not self._wait_first:
            self._start_rest()
        ended = 0
        while ended < len(self.gens):
            index, delta, error = await self._queue.get()
            if error is not None:
                raise error
            if delta is None:
                ended += 1
                if index == 0:
                    self._start_rest()
                yield index, None
                continue
            if index == 0 and delta.tokens:
                self._start_rest()
            yield index, delta

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
