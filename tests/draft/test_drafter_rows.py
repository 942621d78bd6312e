"""Every drafter (ngram, model, mtp, eagle3, dflash, assistant) in batches that mix what a
server really batches, on its real tiny model: rows with LoRA adapters (and a stack) beside
base rows, and rows that draft beside rows that cannot (penalties), seeded sampled rows and a
grammar row, all with logprobs. Each batch's output equals the plain path's, token for token, logprobs to
float rounding — and the drafter really drafted."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeserve.model.tiny.text import ensure_model
from tests.adapters.test_adapters import write_adapter
from tests.conftest import EngineHarness
from tests.draft.test_assistant import assert_same_logprobs
from tests.draft.test_speculative import TEXT, counter, wait_idle

# drafter -> (generated arch, launch overrides of its model)
MODELS = {"ngram": ("qwen3", ["model=tiny"]), "model": ("qwen3", ["model=tiny"]),
          "mtp": ("qwen3_5", ["model=qwen"]), "eagle3": ("qwen3", ["model=tiny"]),
          "dflash": ("qwen3", ["model=tiny"]),
          "assistant": ("gemma4", ["model=tiny", "model.arch=gemma4"])}
DRAFTERS = list(MODELS)
EOS_OFF = {0: -100.0, 2: -100.0}
MAX_TOKENS = 24


def draft_overrides(drafter: str, model_cache: Path) -> list[str]:
    if drafter == "model":   # a bf16 copy of the target: agrees mostly, not always
        path = ensure_model("qwen3", "tiny", "bfloat16", model_cache)
        return ["draft=model", f"draft.path={path}", "draft.num_draft_tokens=4"]
    return [f"draft={drafter}"]


def prompts(h: EngineHarness, n: int) -> list[list[int]]:
    ids = h.loaded.tokenizer.encode(TEXT)
    return [ids[:len(ids) - 5 * i] for i in range(n)]   # ragged lengths


def run(h: EngineHarness, rows: list[tuple[list[int], dict, str | None]]) -> list[dict]:
    """Each row: (prompt, sampling, adapter); sampling's "regex" constrains the row."""
    from pipeserve.grammar.constraint import Constraint, GrammarCompiler

    tok = h.loaded.tokenizer
    text = getattr(h.loaded.model, "language_model", h.loaded.model)
    compiler = GrammarCompiler(tok, text.args.vocab_size, tok.eos_token_ids)
    reqs = []
    for prompt, sampling, adapter in rows:
        sampling = dict(sampling)
        regex = sampling.pop("regex", None)
        req = h.request(prompt, max_tokens=MAX_TOKENS, logit_bias=EOS_OFF, logprobs=True,
                        top_logprobs=2, **sampling)
        req.adapter = adapter
        if regex is not None:
            req.grammar = compiler.matcher(Constraint.regex(regex, "guided_regex"))
        reqs.append(req)
    return asyncio.run(h.generate_many(reqs))


def assert_equal_output(got: list[dict], want: list[dict]) -> None:
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert_same_logprobs(got, want)
    for g, w in zip(got, want):   # the top alternatives too
        assert [[t for t, _ in x.top] for x in g["logprobs"]] == \
               [[t for t, _ in x.top] for x in w["logprobs"]]


def drafted(h: EngineHarness, drafter: str) -> float:
    return counter(h, "spec_verifies", drafter)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_drafting_rows_beside_rows_that_cannot_draft(engine_factory, model_cache: Path,
                                                     drafter: str) -> None:
    """One batch: two greedy rows (ragged), a row with a repetition penalty (it decodes one
    token per step: no drafts), a seeded sampled row, a greedy row with top-k and a row under
    a regex (its drafts cut to what its grammar accepts)."""
    _, model = MODELS[drafter]
    common = [*model, "scheduler=continuous", "scheduler.max_batch=8", "cache=off"]
    plain = engine_factory(*common)
    p = prompts(plain, 3)
    rows = [(p[0], {}, None), (p[1], {}, None),
            (p[2], {"repetition_penalty": 1.3}, None),
            (p[0], {"temperature": 0.8, "top_k": 8, "seed": 7}, None),
            (p[1], {"top_k": 4}, None),
            (p[2], {"regex": r"(.|\n){1,60}"}, None)]
    want = run(plain, rows)
    spec = engine_factory(*common, *draft_overrides(drafter, model_cache))
    assert_equal_output(run(spec, rows), want)
    assert drafted(spec, drafter) > 0
    wait_idle(spec)


@pytest.fixture(scope="module")
def adapter_roots(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    """Two adapters per generated arch, on the MLP (every arch has one) and, for one, the
    attention output too where the arch names it so."""
    roots = {}
    for arch in ("qwen3", "qwen3_5", "gemma4"):
        base = ensure_model(arch, "tiny", "float32", model_cache)
        root = roots[arch] = tmp_path_factory.mktemp(f"adapters-{arch}")
        write_adapter(root, "a", base, rank=4, num_layers=2, seed=0, keys=["mlp.down_proj"])
        write_adapter(root, "b", base, rank=8, num_layers=1, seed=2,
                      keys=["mlp.up_proj", "mlp.down_proj"])
    return roots


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_lora_rows_in_the_batch(engine_factory, model_cache: Path, adapter_roots,
                                drafter: str) -> None:
    """Rows of different adapters, a stack and base rows in one batch: verify runs each row
    with its own adapters (the drafter drafts from the adapted target's states, or unadapted
    for draft=model), so the output equals the plain path's row for row."""
    arch, model = MODELS[drafter]
    common = [*model, "scheduler=continuous", "scheduler.max_batch=8", "cache=off",
              f"model.adapter_dir={adapter_roots[arch]}", "model.adapters=[a,b]"]
    plain = engine_factory(*common)
    p = prompts(plain, 3)
    rows = [(p[0], {}, "a"), (p[1], {}, None), (p[2], {}, "a+b"), (p[0], {}, "b")]
    want = run(plain, rows)
    assert want[0]["ids"] != run(plain, [(p[0], {}, None)])[0]["ids"]   # the adapter matters
    spec = engine_factory(*common, *draft_overrides(drafter, model_cache))
    assert_equal_output(run(spec, rows), want)
    assert drafted(spec, drafter) > 0
    wait_idle(spec)
