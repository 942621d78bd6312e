"""A long chat through the HTTP side in-process (tests/http/scripted.py: the real app, request
stages and tokenizer, a scripted engine): an agent's next turn, and the same request again,
reach the engine as exactly the ids plain encoding of the rendered chat gives, while the
request stages encode only what follows the history they share with the turn before
(pipeserve/eventloop/encode_reuse.py). No model weights."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeserve.eventloop.encode_reuse import MIN_CHARS
from tests.conftest import make_config
from tests.http.scripted import InProcess, tokenizer_side

DOC = (Path(__file__).resolve().parents[2] / "docs" / "how-it-works.md").read_text()
ANSWER = "Hello there, friend."   # what the scripted engine says


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    cfg = make_config(f"model.cache_dir={tmp_path_factory.mktemp('models')}")
    model = tokenizer_side(cfg)   # room for a long chat in the tiny model's 4k context
    app = InProcess(cfg, replace(model, max_context=65536))
    yield app
    app.close()


def plain(setup: InProcess, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = setup.model.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def send(setup: InProcess, messages: list[dict[str, str]]) -> tuple[dict[str, Any], list[int]]:
    async def scenario(client: Any) -> Any:
        return await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 32})
    r, engine = setup.run(scenario)
    assert r.status_code == 200, r.text
    (req,) = engine.submitted
    return r.json(), req.prompt_ids


def test_next_turns_reach_the_engine_as_plain_encoding_gives_them(setup: InProcess) -> None:
    app = next(a for a in __import__("sanic").Sanic._app_registry.values()
               if a.ctx.front is not None and a.ctx.engine is setup.engine)
    reuse = app.ctx.front.tokenize.encoder.reuse
    assert reuse is not None
    messages = [{"role": "system", "content": DOC[:MIN_CHARS]},
                {"role": "user", "content": "What does the engine thread own?"}]
    body, ids = send(setup, messages)
    assert ids == plain(setup, messages)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == ANSWER
    before = reuse.reused_tokens
    _, again = send(setup, messages)   # a retry of the same request
    assert again == ids and reuse.reused_tokens - before > len(ids) - 16
    for turn in range(3):   # the agent goes on: each turn extends the last
        messages += [{"role": "assistant", "content": ANSWER},
                     {"role": "user",
                      "content": f"And step {turn}? {DOC[turn * 500:turn * 500 + 700]}"}]
        before = reuse.reused_tokens
        body, ids_turn = send(setup, messages)
        assert ids_turn == plain(setup, messages)
        assert body["usage"]["prompt_tokens"] == len(ids_turn)
        assert reuse.reused_tokens - before >= len(ids) - 16   # the history was not encoded again
        ids = ids_turn
