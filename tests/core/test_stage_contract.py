"""A third-party stage with the documented signature replaces a slot from the config: here
`pipeline.sample`, filled by a class of this module built as `Cls(cfg, deps)` and called as
`(logits: Logits, rows) -> Sampled`, using only public names of pipeserve.core.plan/pipeline.core.stage.
Its effect is visible in the output: it always picks the second most likely token, and the
served tokens equal mlx-lm's own loop with that sampler — with drafts too (verify picks with
the configured sample stage). A replaced persist gets all it needs from its constructor."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from pipeserve.config import ServeConfig
from pipeserve.core.plan import Logits, Sampled
from pipeserve.request import Request
from pipeserve.core.stage import StageDeps
from pipeserve.model.tiny.text import ensure_model
from tests.conftest import startup_error

HERE = "tests.core.test_stage_contract"
PROMPTS = [[11, 12, 13, 14, 15], [40 + i for i in range(37)]]


def second_best(logits: mx.array) -> mx.array:
    """Per row, the id of the second-highest logit."""
    return mx.argsort(-logits, axis=-1)[:, 1].astype(mx.uint32)


class SecondBest:
    """A user's sampler: the runner-up token, always. Keeps what it was called with."""

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        self.vocab = deps.loaded.config.get("vocab_size")
        self.calls: list[tuple[list[str], list[str]]] = []

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled:
        self.calls.append((list(logits.order), [r.request_id for r in rows]))
        if not rows:
            return Sampled(list(logits.order), None)
        return Sampled(list(logits.order), second_best(logits.logits))


class NoDeps:
    """Wrong constructor: takes neither the config nor the deps."""

    def __init__(self) -> None: ...

    def __call__(self, logits: Logits, rows: Sequence[Request]) -> Sampled: ...


class WrongCall:
    """Right constructor, wrong call: only the logits."""

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None: ...

    def __call__(self, logits: Logits) -> Sampled:
        raise AssertionError("never called with one argument")


class ForwardingPersist:
    """The built-in persist behind a stand-in. Only the Persist protocol's calls are
    forwarded: nothing is set on a stage after it is built (the ledger and the sampler keys
    come in `deps`)."""

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        from pipeserve.stages.persist import Persist
        self.inner = Persist(cfg, deps)

    def prompts(self, plan, kv) -> None:
        self.inner.prompts(plan, kv)

    def drain(self, kv, rows) -> None:
        self.inner.drain(kv, rows)

    def waiting(self, rid) -> bool:
        return self.inner.waiting(rid)

    def __call__(self, finished, running, kv) -> None:
        self.inner(finished, running, kv)


class PersistThatFailsOnce(ForwardingPersist):
    """The built-in persist, whose first retirement fails the way a full device does."""

    failed = False

    def __call__(self, finished, running, kv) -> None:
        if finished and not self.failed:
            self.failed = True
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        self.inner(finished, running, kv)


class PersistThatWaits(ForwardingPersist):
    """The built-in persist, whose retirement of finished rows waits until the test lets it
    go (`GATE`), saying when it started (`STARTED`): a slow store (128 rows finishing at once
    copied 9,216 layer slices on the 8B) made visible."""

    GATE = threading.Event()
    STARTED = threading.Event()

    def __call__(self, finished, running, kv) -> None:
        if finished:
            self.STARTED.set()
            assert self.GATE.wait(30), "the test never let persist go on"
        self.inner(finished, running, kv)


def reference(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own loop with the same choice of token, stopped at EOS."""
    model, tokenizer = mlx_load(str(path))
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  sampler=second_best):
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


def test_a_third_party_sample_stage_replaces_the_builtin(engine_factory, model_cache) -> None:
    builtin = engine_factory("scheduler=serial")
    mine = engine_factory("scheduler=serial", f"pipeline.sample._target_={HERE}.SecondBest")
    stage = mine.engine.step.sample
    assert type(stage).__name__ == "SecondBest" and stage.vocab
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    for prompt in PROMPTS:
        plain = builtin.generate(prompt, max_tokens=12)["ids"]
        got = mine.generate(prompt, max_tokens=12)["ids"]
        assert got == reference(path, prompt, 12)   # exactly what the class decides
        assert got != plain and len(got) > 3
    # called with the rows that sample, in the logits' order, one call per sampled token
    sampled = [c for c in stage.calls if c[1]]
    assert all(order == rows for order, rows in sampled)
    assert len(sampled) >= len(PROMPTS) * 4


def test_a_third_party_sample_stage_serves_batched_rows(engine_factory) -> None:
    """In continuous batching the class gets every decoding row at once, and each row's
    output is the same as that row served alone."""
    solo = engine_factory("scheduler=serial", f"pipeline.sample._target_={HERE}.SecondBest")
    expected = [solo.generate(p, max_tokens=10)["ids"] for p in PROMPTS]
    h = engine_factory("scheduler=continuous", "scheduler.max_batch=4",
                       f"pipeline.sample._target_={HERE}.SecondBest")
    got = asyncio.run(h.generate_many([h.request(p, max_tokens=10) for p in PROMPTS]))
    assert [g["ids"] for g in got] == expected
    assert max(len(rows) for _, rows in h.engine.step.sample.calls) == len(PROMPTS)


@pytest.mark.parametrize("model,draft", [("tiny", "ngram"), ("qwen", "mtp")])
def test_a_third_party_sample_stage_drafts_and_equals_its_plain_path(
        engine_factory, model: str, draft: str) -> None:
    """With draft≠none, verify picks each drafted position's token with the configured sample
    stage, so the class's output with drafts equals its output without, token for token —
    batched rows, drafts proposed and some kept — and differs from the built-in sampler's."""
    mine = f"pipeline.sample._target_={HERE}.SecondBest"
    prompts = [[11, 12, 13, 14, 15] * 4, [40 + i % 9 for i in range(37)]]
    builtin = engine_factory(f"model={model}", f"draft={draft}")
    plain = engine_factory(f"model={model}", mine)
    # (a fixed draft length: the class's picks rarely meet the head's greedy drafts, and an
    # adaptive row would stop drafting before any is kept)
    spec = engine_factory(f"model={model}", mine, f"draft={draft}", "draft.adaptive=false")

    def run(h) -> list[list[int]]:
        got = asyncio.run(h.generate_many([h.request(p, max_tokens=24) for p in prompts]))
        return [g["ids"] for g in got]

    expected = run(plain)
    assert run(spec) == expected
    assert run(builtin) != expected
    proposed = spec.metrics.spec_proposed.labels(draft)._value.get()
    accepted = spec.metrics.spec_accepted.labels(draft)._value.get()
    assert proposed > 0 and 0 < accepted <= proposed
    # verify asked the class about drafted positions (more calls than tokens sampled plainly)
    assert len(spec.engine.step.sample.calls) > len(plain.engine.step.sample.calls)


def test_a_sample_class_with_the_wrong_constructor_fails_at_launch(model_cache) -> None:
    msg = startup_error(model_cache, f"pipeline.sample._target_={HERE}.NoDeps")
    assert "NoDeps" in msg and "positional argument" in msg


def test_an_unimportable_sample_target_fails_at_config_time() -> None:
    from pipeserve.errors import ConfigError
    from tests.conftest import make_config
    with pytest.raises(ConfigError, match="pipeline.sample._target_"):
        make_config(f"pipeline.sample._target_={HERE}.Missing")


def test_a_sample_class_with_the_wrong_call_fails_its_request(engine_factory, caplog) -> None:
    """Not checked at launch (only the constructor runs there): each step that samples fails
    its requests with a retryable 503 (the TypeError in the server log); the engine goes on."""
    from pipeserve.errors import EngineUnavailable
    h = engine_factory("scheduler=serial", f"pipeline.sample._target_={HERE}.WrongCall")
    for _ in range(2):
        with pytest.raises(EngineUnavailable, match="step .* failed"):
            h.generate([1, 2, 3], max_tokens=4, timeout_s=60)
    assert "WrongCall.__call__() takes 2 positional arguments" in caplog.text
    assert h.engine.scheduler.running == [] and h.engine.step.kv.num_rows == 0


def test_a_failing_persist_costs_only_its_cache_entries(engine_factory, caplog) -> None:
    """Persist runs after a row's last token went out; when it fails (as an out-of-memory
    device did) the row still finishes with its whole output, its KV is freed, the
    error is logged, and the engine serves the next request exactly as before."""
    plain = engine_factory("scheduler=serial")
    want = [plain.generate(p, max_tokens=8)["ids"] for p in PROMPTS]
    h = engine_factory("scheduler=serial", f"pipeline.persist._target_={HERE}.PersistThatFailsOnce")
    got = [h.generate(p, max_tokens=8) for p in PROMPTS]
    assert [g["ids"] for g in got] == want
    assert got[0]["finish"] == "length" and got[1]["finish"] == "length"
    assert "persist failed; 1 finished row(s) are not cached" in caplog.text
    assert h.engine.state.value == "ready" and h.engine.step.kv.num_rows == 0
    again = h.generate(PROMPTS[1], max_tokens=8)   # the second one was cached: a hit
    assert again["ids"] == want[1] and again["cached"] > 0


def test_a_finish_is_out_before_its_row_is_stored_and_the_next_turn_still_hits(
        engine_factory) -> None:
    """A client's finish never waits for the engine's bookkeeping: while persist is still
    storing the finished row (held here), the request has its whole output and its finish;
    the engine takes the client's next turn only after the row is stored, so that turn is a
    hit, with the output of an engine that never held persist."""
    plain = engine_factory("scheduler=serial")
    prompt, turn = PROMPTS[1], [60, 61, 62]
    want = plain.generate(prompt, max_tokens=8)["ids"]
    want_next = plain.generate(prompt + want + turn, max_tokens=8)["ids"]
    h = engine_factory("scheduler=serial", f"pipeline.persist._target_={HERE}.PersistThatWaits")
    PersistThatWaits.GATE.clear()
    PersistThatWaits.STARTED.clear()

    async def first() -> tuple[list[int], str, bool]:
        from pipeserve.core.events import Finished, TokenDelta
        from pipeserve.core.stream import RequestStream
        stream = RequestStream(asyncio.get_running_loop())
        h.engine.submit(h.request(prompt, max_tokens=8), stream)
        ids: list[int] = []
        while True:
            event = await stream.next()
            if isinstance(event, TokenDelta):
                ids.extend(event.token_ids)
            else:
                assert isinstance(event, Finished), event
                return ids, event.reason.value, PersistThatWaits.GATE.is_set()

    try:
        ids, reason, let_go = asyncio.run(asyncio.wait_for(first(), 120))
        assert (ids, reason) == (want, "length")
        assert not let_go                                  # the finish came while persist waited
        assert PersistThatWaits.STARTED.wait(60)           # ... inside the row's store
        assert h.engine.step.kv.num_rows == 1              # its KV still held for the copy
    finally:
        PersistThatWaits.GATE.set()
    again = h.generate(prompt + want + turn, max_tokens=8)
    assert again["ids"] == want_next
    assert again["cached"] >= len(prompt) + len(want) - 1   # the stored row served the turn
    assert h.engine.step.kv.num_rows == 0
