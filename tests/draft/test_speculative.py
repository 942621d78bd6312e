"""Speculative decoding (draft → verify) on real tiny models: greedy output equals draft=none
for every proposer, serial and batched, on attention-only and hybrid models; acceptance is
counted; sampling keeps the target's distribution; bad compositions are refused at launch."""
from __future__ import annotations

import asyncio
import logging
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import pytest

from pipeserve.errors import ConfigError
from pipeserve.model.tiny.text import ensure_model
from pipeserve.core.events import Flush
from tests.conftest import EngineHarness, make_config
from tests.conftest import startup_error as engine_startup_error
from tests.core.test_batching import wait_idle

TEXT = ("The morning train left the station at seven, and the passengers settled into their "
        "seats. The morning train left the station at seven, and the passengers")
ARCH = {"tiny": "qwen3", "hybrid": "qwen3_next", "qwen": "qwen3_5"}


def prompts(h: EngineHarness, n: int) -> list[list[int]]:
    ids = h.loaded.tokenizer.encode(TEXT)
    return [ids[:len(ids) - 4 * i] for i in range(n)]   # ragged lengths


def run(h: EngineHarness, n: int, max_tokens: int = 32, **kw) -> list[dict]:
    reqs = [h.request(p, max_tokens=max_tokens, **kw) for p in prompts(h, n)]
    return asyncio.run(h.generate_many(reqs))


def counter(h: EngineHarness, family: str, proposer: str) -> float:
    return getattr(h.metrics, family).labels(proposer)._value.get()


def draft_overrides(proposer: str, model: str, model_cache: Path) -> list[str]:
    if proposer == "model":   # a bf16 copy of the target: agrees mostly, not always
        path = ensure_model(ARCH[model], "tiny", "bfloat16", model_cache)
        return ["draft=model", f"draft.path={path}", "draft.num_draft_tokens=4"]
    return [f"draft={proposer}"]


CASES = [("ngram", "tiny"), ("model", "tiny"), ("ngram", "hybrid"), ("model", "hybrid"),
         ("mtp", "hybrid"), ("mtp", "qwen"), ("eagle3", "tiny"), ("eagle3", "hybrid"),
         ("dflash", "tiny"), ("dflash", "hybrid"), ("eagle3", "qwen"), ("dflash", "qwen")]


# draft.gate: off (every step drafts), on (it drafts or not by measured goodput: the timing
# decides when), and on with a ratio drafting cannot reach (off once it has measured both)
GATES = {"ungated": ["draft.gate=false"], "gated": ["draft.gate=true"],
         "gated-off": ["draft.gate=true", "draft.gate_ratio=100"]}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("scheduler", ["serial", "continuous"])
@pytest.mark.parametrize("proposer,model", CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_greedy_equals_plain_decode(engine_factory, model_cache: Path, proposer: str,
                                    model: str, scheduler: str, gate: str) -> None:
    n = 1 if scheduler == "serial" else 3
    plain = engine_factory(f"model={model}", f"scheduler={scheduler}")
    expected = [g["ids"] for g in run(plain, n, logprobs=True)]
    spec = engine_factory(f"model={model}", f"scheduler={scheduler}",
                          *draft_overrides(proposer, model, model_cache), *GATES[gate])
    got = run(spec, n, logprobs=True)
    assert [g["ids"] for g in got] == expected
    assert all(len(g["logprobs"]) == len(g["ids"]) for g in got)
    proposed = counter(spec, "spec_proposed", proposer)
    accepted = counter(spec, "spec_accepted", proposer)
    assert proposed > 0 and 0 <= accepted <= proposed   # (a gated bucket's first steps draft)
    # the bf16 draft, the generated EAGLE-3 head and the Qwen3.5 stand-in's MTP head are right
    # at times (the generated DFlash drafter is random: it may never be)
    if gate == "ungated" and (proposer in ("model", "eagle3") or (proposer, model) == ("mtp",
                                                                                     "qwen")):
        assert accepted > 0
    wait_idle(spec)


def test_target_as_its_own_draft_accepts_everything(engine_factory, model_cache: Path) -> None:
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    plain = engine_factory("model=tiny")
    expected = [g["ids"] for g in run(plain, 4, max_tokens=30)]
    spec = engine_factory("model=tiny", "draft=model", f"draft.path={path}",
                          "draft.num_draft_tokens=4")
    got = run(spec, 4, max_tokens=30)
    assert [g["ids"] for g in got] == expected
    proposed = counter(spec, "spec_proposed", "model")
    assert proposed > 0 and counter(spec, "spec_accepted", "model") == proposed
    # 30 tokens in rounds of 5 (4 drafts + the target's own): about 6 verifies per row
    verifies = counter(spec, "spec_verifies", "model")
    assert verifies <= 4 * 7


def test_ragged_acceptance_in_one_batch(engine_factory, model_cache: Path) -> None:
    """Rows accept different numbers of drafts in the same verify forward: the emitted-tokens
    histogram shows several sizes, and every row still equals its plain decode."""
    plain = engine_factory("model=tiny", "scheduler.max_batch=6")
    expected = [g["ids"] for g in run(plain, 6, max_tokens=40)]
    spec = engine_factory("model=tiny", "scheduler.max_batch=6", "draft=ngram")
    got = run(spec, 6, max_tokens=40)
    assert [g["ids"] for g in got] == expected
    hist = spec.metrics.spec_emitted.labels("ngram")
    buckets = {s.labels["le"]: s.value for s in hist.collect()[0].samples
               if s.name.endswith("_bucket")}
    counts = [buckets[le] for le in ("1.0", "2.0", "3.0", "4.0", "5.0")]
    sizes = [b - a for a, b in zip([0.0] + counts, counts)]
    assert sum(1 for s in sizes if s > 0) >= 2, f"one acceptance size only: {sizes}"
    assert spec.metrics.batch_size._sum.get() > 6 * 10   # the rows really shared steps


def test_cancel_mid_verify_frees_everything(engine_factory, model_cache: Path) -> None:
    spec = engine_factory("model=hybrid", *draft_overrides("model", "hybrid", model_cache))

    async def go() -> list[dict]:
        reqs = [spec.request(p, max_tokens=200) for p in prompts(spec, 3)]
        task = asyncio.ensure_future(spec.generate_many(reqs))
        deadline = time.monotonic() + 30
        while counter(spec, "spec_verifies", "model") < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        spec.engine.abort(reqs[1].request_id)
        return await task

    got = asyncio.run(go())
    assert got[1]["finish"] == "abort" and len(got[1]["ids"]) < 200
    assert [len(g["ids"]) for i, g in enumerate(got) if i != 1] == [200, 200]
    wait_idle(spec)
    assert spec.engine.step.draft.proposer.kv.num_rows == 0   # the cancelled row's too


def test_sampling_keeps_the_target_distribution(engine_factory, model_cache: Path) -> None:
    """T=1, top_k=4: the first generated token's empirical distribution (each one passed
    through the acceptance rule against an always-greedy draft) matches the target's own
    top-4 softmax within a chi-square bound (3 degrees of freedom, p = 0.001)."""
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    spec = engine_factory("model=tiny", "draft=model", f"draft.path={path}",
                          "draft.num_draft_tokens=2", "scheduler.max_batch=16", "cache=off")
    prompt = prompts(spec, 1)[0]
    logits = spec.loaded.model(mx.array(prompt, dtype=mx.uint32)[None])[0, -1]
    top = mx.argsort(-logits)[:4]
    p = mx.softmax(logits[top]).tolist()
    top = top.tolist()
    n = 480
    reqs = [spec.request(prompt, max_tokens=3, temperature=1.0, top_k=4, seed=1000 + i)
            for i in range(n)]
    got = asyncio.run(spec.generate_many(reqs, timeout_s=300))
    assert counter(spec, "spec_proposed", "model") > 0
    firsts = [g["ids"][0] for g in got]
    assert set(firsts) <= set(top)
    chi2 = sum((firsts.count(t) - n * q) ** 2 / (n * q) for t, q in zip(top, p))
    assert chi2 < 16.27, f"chi2={chi2:.2f} counts={[firsts.count(t) for t in top]} p={p}"


def test_launch_refusals(tmp_path: Path, model_cache: Path) -> None:
    with pytest.raises(ConfigError, match="draft.path.*only used by draft=model"):
        make_config("draft=ngram", "draft.path=/models/x")
    def startup_error(*overrides: str) -> str:
        return engine_startup_error(model_cache, *overrides)

    assert "no multi-token-prediction head" in startup_error("model=tiny", "draft=mtp")
    # model=qwen is the MTP family, but a dense Qwen3 checkpoint under it has no head
    dense = ensure_model("qwen3", "tiny", "float32", model_cache)
    msg = startup_error("model=qwen", f"model.path={dense}", "draft=mtp")
    assert "no multi-token-prediction head" in msg and str(dense) in msg
    # a draft whose tokenizer differs (one extra vocabulary entry)
    src = ensure_model("qwen3", "tiny", "float32", model_cache)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(src, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zzzz-extra"] = max(tok["model"]["vocab"].values()) + 1
    (other / "tokenizer.json").write_text(json.dumps(tok))
    msg = startup_error("model=tiny", "draft=model", f"draft.path={other}")
    assert "tokenizer differs" in msg


@pytest.mark.parametrize("pattern", [r"[a-z ,.]{5,40}", r"(.|\n){1,50}"])
def test_structured_output_rows_draft_under_their_grammar(engine_factory, model_cache: Path,
                                                         pattern: str) -> None:
    """Grammar rows draft too: drafts are cut to what the grammar accepts and verify masks
    every position with the grammar's state there, so output equals draft=none's."""
    from pipeserve.grammar.constraint import Constraint, GrammarCompiler

    def constrained(h: EngineHarness) -> list[list[int]]:
        tok = h.loaded.tokenizer
        compiler = GrammarCompiler(tok, h.loaded.model.args.vocab_size, tok.eos_token_ids)
        reqs = []
        for p in prompts(h, 3):
            req = h.request(p, max_tokens=40)
            req.grammar = compiler.matcher(Constraint.regex(pattern, "guided_regex"))
            reqs.append(req)
        return [g["ids"] for g in asyncio.run(h.generate_many(reqs))]

    expected = constrained(engine_factory("model=tiny"))
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    spec = engine_factory("model=tiny", "draft=model", f"draft.path={path}",
                          "draft.num_draft_tokens=4")
    assert constrained(spec) == expected
    assert counter(spec, "spec_accepted", "model") > 0


@pytest.mark.parametrize("kv", [["kv=q8"], ["kv=turbo"], ["kv=q8", "kv.quantized_start=40"],
                                ["kv=paged", "kv.block_size=16", "kv.pool_blocks=128"]],
                         ids=["q8", "turbo", "q8-delayed", "paged"])
def test_drafts_compose_with_every_trimmable_layout(engine_factory, model_cache: Path,
                                                    kv: list[str]) -> None:
    # the three arrivals prefilled as one group by both engines: kv=turbo's output depends on
    # which rows share a step (a row alone first, then two together, differs from three
    # together at token 20 on this model), and on a loaded machine an engine that wakes on
    # the first submit would take it alone
    small = ["model=tiny", "model.size=small", "scheduler.arrival_gap_ms=100",
             "scheduler.arrival_window_ms=2000"]
    plain = engine_factory(*small, *kv)
    expected = [g["ids"] for g in run(plain, 3, max_tokens=24)]
    if kv[0] == "kv=paged":   # (draft=model with kv=paged is refused at launch)
        spec = engine_factory(*small, *kv, "draft=ngram")
        proposer = "ngram"
    else:
        draft = ensure_model("qwen3", "small", "bfloat16", model_cache)
        spec = engine_factory(*small, *kv, "draft=model", f"draft.path={draft}",
                              "draft.num_draft_tokens=3")
        proposer = "model"
    assert [g["ids"] for g in run(spec, 3, max_tokens=24)] == expected
    assert counter(spec, "spec_proposed", proposer) > 0
    if proposer == "model":
        assert counter(spec, "spec_accepted", proposer) > 0
    wait_idle(spec)


def test_draft_model_state_is_freed_with_its_rows(engine_factory, model_cache: Path) -> None:
    """The draft model's row store holds only running rows: finished and cancelled rows
    leave it."""
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    spec = engine_factory("model=tiny", "draft=model", f"draft.path={path}")
    run(spec, 4, max_tokens=20)
    wait_idle(spec)
    proposer = spec.engine.step.draft.proposer
    assert proposer.kv.num_rows == 0 and proposer.kv.decode_rows == []
    assert proposer.kv.nbytes == 0 and proposer.held == {}


def test_drafting_pauses_above_a_batch_size(engine_factory) -> None:
    """draft.disable_by_batch_size: while more rows decode than that, steps decode plainly
    (the drafter is not asked: counted as batch-off steps); a lone row drafts; output stays
    equal to draft=none."""
    plain = engine_factory("model=tiny")
    expected = [g["ids"] for g in run(plain, 4, max_tokens=30)]
    always = engine_factory("model=tiny", "draft=ngram")
    run(always, 4, max_tokens=30)
    assert counter(always, "spec_batch_off_steps", "ngram") == 0
    capped = engine_factory("model=tiny", "draft=ngram", "draft.disable_by_batch_size=1")
    assert [g["ids"] for g in run(capped, 4, max_tokens=30)] == expected
    assert counter(capped, "spec_proposed", "ngram") < counter(always, "spec_proposed", "ngram")
    off = counter(capped, "spec_batch_off_steps", "ngram")
    assert off > 0
    before = counter(capped, "spec_proposed", "ngram")
    run(capped, 1, max_tokens=30)   # alone: drafts again, no step off
    assert counter(capped, "spec_proposed", "ngram") > before
    assert counter(capped, "spec_batch_off_steps", "ngram") == off


@pytest.mark.parametrize("proposer,model", [("eagle3", "tiny"), ("mtp", "qwen"),
                                            ("dflash", "tiny")])
def test_the_gate_turns_drafting_off_where_it_loses(engine_factory, proposer: str, model: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """draft.gate: a batch-size bucket whose drafting goodput loses to plain steps stops
    drafting once it has measured both (draft.gate_ratio=100, which no drafter reaches, so
    the outcome does not hang on this machine's timings): the row proposes only in its first
    steps, the gauge says off for one decoding row, the log says so; a ratio every drafter
    reaches keeps it drafting. A probe after the wait drafts from a head that skipped the
    plain steps' hidden states. Output equals draft=none throughout."""
    from pipeserve.draft import gate
    plain = engine_factory(f"model={model}")
    expected = [g["ids"] for g in run(plain, 1, max_tokens=60)]
    drafting = [f"model={model}", f"draft={proposer}", "draft.gate=true"]
    kept = engine_factory(*drafting, "draft.gate_ratio=0.01")
    with caplog.at_level(logging.INFO, logger="pipeserve"):
        off = engine_factory(*drafting, "draft.gate_ratio=100")
        got_off = run(off, 1, max_tokens=60)
    got_kept = run(kept, 1, max_tokens=60)
    assert [g["ids"] for g in got_off] == [g["ids"] for g in got_kept] == expected

    def gauge(h: EngineHarness) -> float:
        return h.metrics.spec_gate_open.labels(proposer, "1")._value.get()

    def switches(h: EngineHarness, to: str) -> float:
        return h.metrics.spec_gate_switches.labels(proposer, "1", to)._value.get()

    assert gauge(off) == 0 and switches(off, "off") == 1 and switches(off, "on") == 0
    assert gauge(kept) == 1 and switches(kept, "off") == switches(kept, "on") == 0
    # the first run drafts; then the 60 tokens end before the first probe of drafting
    verifies = counter(off, "spec_verifies", proposer)
    assert 0 < verifies <= gate.FIRST_RUN < counter(kept, "spec_verifies", proposer)
    spec = got_off[0]["extras"]["speculation"]
    assert 0 < spec["proposed"] <= gate.FIRST_RUN * off.cfg.draft.num_draft_tokens
    assert len(expected[0]) - spec["accepted"] > gate.FIRST_RUN + gate.PROBE_STEPS   # steps
    assert any(f"draft={proposer}: 1 decoding rows: " in r.getMessage() and
               r.getMessage().endswith("drafting off") for r in caplog.records)
    # the probe: its wait is counted in this machine's step times, so it is shortened here
    # (the engine is idle) to come within the next request; it drafts, loses, and goes off
    wait_idle(off)
    off.engine.step.draft.gate.buckets[0].left = 5
    assert [g["ids"] for g in run(off, 1, max_tokens=60)] == expected
    probed = counter(off, "spec_verifies", proposer) - verifies
    assert 0 < probed <= gate.MIN_SAMPLES
    assert gauge(off) == 0 and switches(off, "on") == 0


@pytest.mark.parametrize("proposer,model", [("ngram", "tiny"), ("model", "tiny"),
                                            ("model", "hybrid"), ("mtp", "hybrid"),
                                            ("mtp", "qwen"), ("eagle3", "tiny"),
                                            ("dflash", "tiny")])
def test_prompt_cache_hot_and_ssd_restore_keep_drafted_output(
        engine_factory, model_cache: Path, tmp_path: Path, proposer: str, model: str) -> None:
    """A drafted request served from a hot prompt cache, then from the SSD tier after a
    restart, gives the plain cold run's tokens (hybrid: exact stored boundaries)."""
    plain = engine_factory(f"model={model}", "cache=off")
    prompt = prompts(plain, 1)[0]
    expected = plain.generate(prompt, max_tokens=24)["ids"]
    ssd = ["cache=ssd", f"cache.ssd.dir={tmp_path}"]
    first = engine_factory(f"model={model}", *ssd, *draft_overrides(proposer, model, model_cache))
    assert first.generate(prompt, max_tokens=24)["ids"] == expected
    hot = first.generate(prompt, max_tokens=24)
    assert hot["cached"] > 0 and hot["ids"] == expected
    assert first.engine.command(Flush()).result(60)
    first.close()
    second = engine_factory(f"model={model}", *ssd, *draft_overrides(proposer, model, model_cache))
    restored = second.generate(prompt, max_tokens=24)
    assert restored["cached"] > 0 and restored["ids"] == expected


@pytest.mark.parametrize("model,kv", [("hybrid", "turbo"), ("qwen", "turbo"), ("qwen", "q8"),
                                      ("qwen", "q4"), ("qwen", "paged")])
def test_mtp_on_recurrent_models_rolls_back_every_layout(engine_factory, model: str,
                                                         kv: str) -> None:
    """draft=mtp on models with recurrent and attention layers, batched: rejected drafts roll
    back the KV layout's caches (turbo's encoded entries, affine groups, paged blocks) and the
    recurrent state alike, so greedy output equals draft=none under the same kv. The Qwen3.5
    stand-in's head is accepted in part, so rows keep some drafts and drop the rest."""
    plain = engine_factory(f"model={model}", f"kv={kv}")
    expected = [g["ids"] for g in run(plain, 4, max_tokens=40)]
    spec = engine_factory(f"model={model}", f"kv={kv}", "draft=mtp", "draft.num_draft_tokens=4")
    assert [g["ids"] for g in run(spec, 4, max_tokens=40)] == expected
    proposed = counter(spec, "spec_proposed", "mtp")
    accepted = counter(spec, "spec_accepted", "mtp")
    assert proposed > 0
    if model == "qwen":   # partial acceptance: some drafts kept, some rolled back
        assert 0 < accepted < proposed
    assert spec.metrics.batch_size._sum.get() > 4 * 5   # the rows shared verify forwards
    wait_idle(spec)


@pytest.mark.parametrize("proposer,model", [("ngram", "tiny"), ("mtp", "qwen"),
                                            ("eagle3", "tiny"), ("dflash", "tiny")])
def test_seeded_sampling_equals_plain_decode(engine_factory, proposer: str, model: str) -> None:
    """Verify picks each drafted position with the sample stage and rewinds the row's sampler
    to the last kept position, so a seeded sampled row draws the keys it draws without drafts:
    the same tokens, batched, with drafts kept along the way."""
    sampling = dict(max_tokens=32, temperature=0.8, top_k=8)

    def go(h: EngineHarness) -> list[list[int]]:
        reqs = [h.request(p, seed=10 + i, **sampling) for i, p in enumerate(prompts(h, 3))]
        return [g["ids"] for g in asyncio.run(h.generate_many(reqs))]

    expected = go(engine_factory(f"model={model}"))
    spec = engine_factory(f"model={model}", f"draft={proposer}")
    assert go(spec) == expected
    assert counter(spec, "spec_proposed", proposer) > 0
    if proposer not in ("eagle3", "dflash"):   # (generated heads rarely meet T=0.8 picks)
        assert counter(spec, "spec_accepted", proposer) > 0


def length_counts(h: EngineHarness, proposer: str) -> dict[str, float]:
    """The draft-length histogram as counts per bucket upper bound ('0.0', '1.0', ...)."""
    hist = h.metrics.spec_draft_length.labels(proposer)
    cumulative = {s.labels["le"]: s.value for s in hist.collect()[0].samples
                  if s.name.endswith("_bucket")}
    out, before = {}, 0.0
    for le, total in cumulative.items():
        out[le] = total - before
        before = total
    return out


def test_adaptive_length_stops_a_failing_drafter(engine_factory, model_cache: Path) -> None:
    """A draft model that disagrees with the target (the tiny llama for the tiny qwen3, same
    tokenizer): with draft.adaptive its rows pause drafting (draft length 0 in the metrics)
    and propose far fewer tokens than at a fixed length, more of them kept; output equals
    draft=none, batched."""
    plain = engine_factory("model=tiny")
    expected = [g["ids"] for g in run(plain, 3, max_tokens=48)]
    other = ensure_model("llama", "tiny", "float32", model_cache)
    drafting = ["model=tiny", "draft=model", f"draft.path={other}", "draft.num_draft_tokens=4"]
    fixed = engine_factory(*drafting, "draft.adaptive=false")
    assert [g["ids"] for g in run(fixed, 3, max_tokens=48)] == expected
    adaptive = engine_factory(*drafting)
    assert [g["ids"] for g in run(adaptive, 3, max_tokens=48)] == expected
    fixed_proposed = counter(fixed, "spec_proposed", "model")
    adaptive_proposed = counter(adaptive, "spec_proposed", "model")
    fixed_rate = counter(fixed, "spec_accepted", "model") / fixed_proposed
    assert fixed_rate < 0.5   # it mostly fails
    assert 0 < adaptive_proposed < 0.7 * fixed_proposed
    assert counter(adaptive, "spec_accepted", "model") / adaptive_proposed > fixed_rate
    lengths = length_counts(adaptive, "model")
    assert lengths["0.0"] > 0 and lengths["4.0"] > 0   # paused steps, and full-length ones
    assert set(k for k, v in length_counts(fixed, "model").items() if v) == {"4.0"}
    wait_idle(adaptive)
    assert adaptive.engine.step.draft.lengths.rows == {}   # finished rows leave the policy


def test_adaptive_length_keeps_a_good_drafter_at_full_length(engine_factory,
                                                             model_cache: Path) -> None:
    """The target as its own draft is always right: every chosen length is draft.num_draft_tokens."""
    path = ensure_model("qwen3", "tiny", "float32", model_cache)
    spec = engine_factory("model=tiny", "draft=model", f"draft.path={path}",
                          "draft.num_draft_tokens=4")
    run(spec, 2, max_tokens=30)
    chosen = {k for k, v in length_counts(spec, "model").items() if v}
    assert chosen == {"4.0"}
