"""A scripted EngineClient and the in-process app around it: the HTTP side (protocol adapters,
request stages, the output path, SSE framing) served by `build_app(cfg, engine=...)` and
driven through ASGI, with an engine that answers each request from a script instead of a
model. The tokenizer is the generated tiny model's, read from its files (no weights load)."""
from __future__ import annotations

import gc
import json
import uuid
from concurrent.futures import Future
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeserve.config import ServeConfig
from pipeserve.core.client import EngineLoad, EngineState
from pipeserve.core.events import Failed, Finished, Flush, TokenDelta, answer
from pipeserve.core.limits import EngineLimits
from pipeserve.core.stream import RequestStream
from pipeserve.errors import ServeError
from pipeserve.model.loader import LoadedModel, _fingerprint, resolve_path
from pipeserve.request import FinishReason, Request


@dataclass
class Reply:
    """What the scripted engine answers one request with: the text it generates (encoded by
    the model's tokenizer, one TokenDelta per token), or an error (one Failed event)."""

    text: str = "Hello there, friend."
    error: ServeError | None = None
    cached: int = 0   # prompt tokens the prompt cache supplied (Finished.num_cached_tokens)


def tokenizer_side(cfg: ServeConfig) -> LoadedModel:
    """The tiny model as the HTTP side holds it: tokenizer and config, no weights (as a pool's
    parent holds a member's model)."""
    from mlx_lm.utils import load_tokenizer

    path = resolve_path(cfg.model)
    config = json.loads((path / "config.json").read_text())
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(model=None, tokenizer=tokenizer, path=path, config=config,
                       fingerprint=_fingerprint(path),
                       max_context=int(config.get("max_position_embeddings") or 4096))


@dataclass
class ScriptedEngine:
    """An EngineClient (pipeserve/core/client.py) that answers every submit at once from
    `script`, posting through the request's stream as the engine thread does."""

    cfg: ServeConfig
    model: LoadedModel
    script: Callable[[Request], Reply] = lambda _req: Reply()
    max_rows: int = 8
    waiting: int = 0   # what load() reports as waiting beyond the free rows (queue checks)
    state: EngineState = EngineState.LOADING
    startup_error: BaseException | None = None
    limits: EngineLimits | None = None
    submitted: list[Request] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.limits = EngineLimits.of(self.cfg, self.model, max_rows=self.max_rows,
                                      device="scripted")
        self.state = EngineState.READY

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.state is EngineState.READY

    def load(self) -> EngineLoad:
        return EngineLoad.of(self.waiting, 0, self.waiting, 0)

    def submit(self, request: Request, stream: RequestStream) -> None:
        self.submitted.append(request)
        reply = self.script(request)
        rid = request.request_id
        if reply.error is not None:
            stream.post(Failed(rid, reply.error))
            return
        ids = list(self.model.tokenizer.encode(reply.text, add_special_tokens=False))
        out = ids[:request.sampling.max_tokens]
        for token in out:
            stream.post(TokenDelta(rid, [token], None, 1))
        reason = FinishReason.STOP if len(out) == len(ids) else FinishReason.LENGTH
        stream.post(Finished(rid, reason, len(request.prompt_ids), len(out), reply.cached,
                             extras={"batch_size_max": 1}))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def coming(self) -> None:
        pass

    def command(self, cmd: Any) -> Future[Any]:
        """A Flush is done at once (no prompt cache); it runs no other command."""
        if not isinstance(cmd, Flush):
            raise NotImplementedError(f"the scripted engine runs no {type(cmd).__name__}")
        answer(cmd.future, True)
        return cmd.future

    def stop(self, timeout: float = 10.0) -> None:
        self.state = EngineState.STOPPED


@asynccontextmanager
async def served(cfg: ServeConfig, engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    """The app around `engine`, started as Sanic starts it (its startup listeners run), and an
    httpx client that speaks to it through ASGI; stopped on the way out."""
    import asyncio

    from sanic import Sanic

    from pipeserve.http.server import build_app

    Sanic.test_mode = True
    app = build_app(cfg, name=f"scripted_{uuid.uuid4().hex[:8]}", engine=engine)
    app.asgi = True
    app.signalize()
    app.finalize()
    await app._startup()
    await app._server_event("init", "before")
    await app._server_event("init", "after")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(200):   # the ready task builds the request stages (bounded)
                if app.ctx.front is not None:
                    break
                await asyncio.sleep(0.01)
            assert app.ctx.front is not None, "the app did not become ready"
            yield client
    finally:
        await app._server_event("shutdown", "before")
        await app._server_event("shutdown", "after")
        loop = asyncio.get_running_loop()
        import signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        Sanic._app_registry.pop(app.name, None)
        gc.unfreeze()   # the app's startup froze the test process's objects (startup.py)


class InProcess:
    """One app around one scripted engine for a module's tests, on an event loop of its own;
    `run` resets the engine's script and records, then runs a scenario against the app."""

    def __init__(self, cfg: ServeConfig, model: LoadedModel) -> None:
        import asyncio

        self.model = model
        self.engine = ScriptedEngine(cfg, model)
        self.loop = asyncio.new_event_loop()
        self._served = served(cfg, self.engine)
        self.client = self.loop.run_until_complete(self._served.__aenter__())

    def run(self, scenario: Callable[[httpx.AsyncClient], Any],
            script: Callable[[Request], Reply] = lambda _req: Reply(),
            waiting: int = 0) -> tuple[Any, ScriptedEngine]:
        e = self.engine
        e.script, e.waiting, e.submitted, e.aborted = script, waiting, [], []
        return self.loop.run_until_complete(scenario(self.client)), e

    def close(self) -> None:
        self.loop.run_until_complete(self._served.__aexit__(None, None, None))
        self.loop.close()


def sse_frames(body: str) -> list[dict[str, str]]:
    """An SSE body as its frames: each a dict of its fields (`id`, `event`, `data`)."""
    frames = []
    for block in body.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ":" not in line:
                continue
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        if fields:
            frames.append(fields)
    return frames


def data_of(frames: list[dict[str, str]]) -> list[Any]:
    """The JSON payloads of the frames' `data` lines ([DONE] kept as the string)."""
    return [f["data"] if f["data"] == "[DONE]" else json.loads(f["data"])
            for f in frames if "data" in f]


__all__ = ["InProcess", "Reply", "ScriptedEngine", "data_of", "served", "sse_frames", "tokenizer_side"]
