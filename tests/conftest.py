"""Shared fixtures: composed configs, an in-process engine on a real tiny model, and a real
`serve.py` process on 127.0.0.1 for end-to-end tests. Everything is bounded in time."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# every host copy of a batch's padding that the engine uses is checked against the device's,
# here and in the servers the tests start (pipeserve/kv/padded.py)
os.environ.setdefault("PIPESERVE_CHECK_PADDING", "1")

import httpx
import pytest
from hydra import compose, initialize_config_dir
from prometheus_client import CollectorRegistry

from pipeserve.config import ServeConfig, check_overrides, load_config, register_configs
from pipeserve.core.engine import Engine
from pipeserve.core.events import Failed, Finished, Settle, TokenDelta
from pipeserve.metrics import Metrics
from pipeserve.request import PromptInput, Request, SamplingParams
from pipeserve.core.stream import RequestStream

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "pipeserve" / "conf"
register_configs()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated tiny models for this test session (deterministic, fast to make)."""
    return tmp_path_factory.mktemp("models")


def pinned(overrides: list[str]) -> list[str]:
    """Tests run on the generated `model=tiny` unless they name a model: the real default model
    (SmolLM2) is for the tests of language behaviour, which ask for it by name. They run with
    draft.gate=false unless they name it: the gate decides from wall-clock timings, and the
    draft counts tests assert must not depend on the machine's load."""
    if not any(o.startswith("draft.gate=") for o in overrides):
        overrides = [*overrides, "draft.gate=false"]
    return overrides if any(o.startswith("model=") for o in overrides) else ["model=tiny", *overrides]


def make_config(*overrides: str) -> ServeConfig:
    overrides = tuple(pinned(list(overrides)))
    check_overrides(list(overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_config(compose("serve", overrides=list(overrides)))


# -- in-process engine -------------------------------------------------------------------
class EngineHarness:
    """A real Engine on a real model, driven without HTTP (for token-level assertions)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics(CollectorRegistry())
        self.engine = Engine(cfg, self.metrics)
        self.engine.start()
        assert self.engine.wait_ready(120), f"engine failed: {self.engine.startup_error!r}"
        self.loaded = self.engine.loaded

    def request(self, prompt_ids: list[int], **sampling: Any) -> Request:
        sp = SamplingParams(**{"temperature": 0.0, **sampling})
        return Request(request_id=f"t-{uuid.uuid4().hex[:8]}", endpoint="test",
                       inputs=PromptInput(token_ids=prompt_ids), prompt_ids=list(prompt_ids),
                       sampling=sp, stop_token_ids=frozenset(self.loaded.tokenizer.eos_token_ids))

    def generate(self, prompt_ids: list[int], timeout_s: float = 120, **sampling: Any) -> dict[str, Any]:
        return asyncio.run(self.generate_many([self.request(prompt_ids, **sampling)], timeout_s))[0]

    async def generate_many(self, requests: list[Request], timeout_s: float = 120) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()

        async def one(req: Request) -> dict[str, Any]:
            stream = RequestStream(loop)
            self.engine.submit(req, stream)
            ids: list[int] = []
            logprobs: list[Any] = []
            while True:
                event = await stream.next()
                if isinstance(event, TokenDelta):
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs or [])
                elif isinstance(event, Finished):
                    return {"ids": ids, "finish": event.reason.value, "logprobs": logprobs,
                            "cached": event.num_cached_tokens, "extras": event.extras}
                else:
                    assert isinstance(event, Failed)
                    raise event.error
        got = await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout_s)
        # a finish goes out before its row is retired: read the engine after that
        await asyncio.wait_for(asyncio.wrap_future(self.engine.command(Settle())), timeout_s)
        return got

    def close(self) -> None:
        self.engine.stop()


def startup_error(model_cache: Path, *overrides: str) -> str:
    """The message an engine that must refuse to start gives (it must not become ready)."""
    engine = Engine(make_config(f"model.cache_dir={model_cache}", *overrides),
                    Metrics(CollectorRegistry()))
    engine.start()
    assert not engine.wait_ready(120), f"engine started with {overrides}"
    return str(engine.startup_error)


@pytest.fixture
def engine_factory(model_cache: Path) -> Iterator[Any]:
    made: list[EngineHarness] = []

    def make(*overrides: str) -> EngineHarness:
        h = EngineHarness(make_config(f"model.cache_dir={model_cache}", *overrides))
        made.append(h)
        return h
    yield make
    for h in made:
        h.close()


# -- a real server process ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, log: Any,
              timeout_s: float) -> None:
    """Poll `url` until it answers 200 (bounded); fail at once if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready in {timeout_s}s:\n{log()}")


class ServerProcess:
    """`python serve.py <overrides>` on a free 127.0.0.1 port; stopped by its own PID."""

    def __init__(self, overrides: list[str], run_dir: Path, model_cache: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / f"serve-{self.port}.log"
        args = [sys.executable, str(ROOT / "serve.py"), f"server.port={self.port}",
                f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir / str(self.port)}",
                *pinned(overrides)]
        if not any(o.startswith("server.files_dir=") for o in overrides):
            # its own files, batches and background responses: a server never resumes another's
            args.append(f"server.files_dir={run_dir / str(self.port) / 'files'}")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_http(f"{self.base_url}/health", self.proc, "serve.py", self.log, timeout_s)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Any]:
    started: list[ServerProcess] = []
    run_dir = tmp_path_factory.mktemp("runs")

    def start(*overrides: str, wait: bool = True) -> ServerProcess:
        s = ServerProcess(list(overrides), run_dir, model_cache)
        started.append(s)
        if wait:
            s.wait_ready()
        return s
    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def server(server_factory: Any) -> ServerProcess:
    """The default server (model=tiny, scheduler=serial)."""
    return server_factory()
