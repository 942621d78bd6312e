"""The think-span grammar on the tiny tokenizer, without a model: reasoning runs until the
model's own end marker, at the budget only that marker may follow, the answer after it is
free, and a prompt that did not open the span lets the model answer at once."""
from __future__ import annotations

import dataclasses


import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeserve.grammar.constraint import Constraint, GrammarCompiler, Matcher
from pipeserve.grammar.think import ThinkSpan, span_grammar
from pipeserve.model.tiny.text import ensure_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_file(str(ensure_model("qwen3", "tiny", "float32",
                                                tmp_path_factory.mktemp("m")) / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    from mlx_lm.tokenizer_utils import load
    wrapper = load(ensure_model("qwen3", "tiny", "float32", tmp_path_factory.mktemp("w")))
    return GrammarCompiler(wrapper, 512, wrapper.eos_token_ids)


def span(tok: Tokenizer, opened: bool, budget: int | None) -> ThinkSpan:
    ids = lambda t: tuple(tok.encode(t).ids)   # noqa: E731
    return ThinkSpan("<think>", ids("<think>"), "</think>", ids("</think>"), opened, budget)


def matcher(compiler: GrammarCompiler, text: str) -> Matcher:
    return compiler.matcher(Constraint.grammar(text, "max_reasoning_tokens"))


def allowed(m: Matcher) -> set[int]:
    bits = np.unpackbits(m.allowed_mask().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:512]).tolist())


def test_the_budget_forces_the_end_marker_then_the_answer_is_free(
        tok: Tokenizer, compiler: GrammarCompiler) -> None:
    close = tok.encode("</think>").ids
    m = matcher(compiler, span_grammar(span(tok, opened=True, budget=3)))
    for t in tok.encode("The morning train").ids[:3]:
        assert m.accept(t)
    for t in close:   # at the budget, only the marker, token by token
        assert allowed(m) == {t}
        assert m.accept(t)
    assert len(allowed(m)) > 100 and m.is_accepting()   # free text (or the end) after it


def test_the_model_may_close_early_and_may_skip_an_unopened_span(
        tok: Tokenizer, compiler: GrammarCompiler) -> None:
    m = matcher(compiler, span_grammar(span(tok, opened=True, budget=50)))
    assert all(m.accept(t) for t in tok.encode("ab</think>\nThe answer").ids)
    m = matcher(compiler, span_grammar(span(tok, opened=False, budget=2)))
    assert all(m.accept(t) for t in tok.encode("Plain answer, no span").ids)
    m = matcher(compiler, span_grammar(span(tok, opened=False, budget=2)))
    ids = tok.encode("<think>").ids + tok.encode("The morning train").ids[:2]
    assert all(m.accept(t) for t in ids)
    assert allowed(m) == {tok.encode("</think>").ids[0]}


def test_added_tokens_pass_in_the_answer_whether_or_not_the_model_thinks(
        tok: Tokenizer, compiler: GrammarCompiler) -> None:
    """A call after (or instead of) budgeted reasoning: <tool_call> is an added token, which
    text never holds; the answer admits the added tokens it is given."""
    call = tok.token_to_id("<tool_call>")
    s = ThinkSpan("<think>", tuple(tok.encode("<think>").ids), "</think>",
                  tuple(tok.encode("</think>").ids), True, 2, (), (call,))
    m = matcher(compiler, span_grammar(s))
    assert call not in allowed(m)   # budgeted reasoning is text
    assert all(m.accept(t) for t in tok.encode("ab</think>\n").ids)
    assert call in allowed(m) and m.accept(call)
    m = matcher(compiler, span_grammar(dataclasses.replace(s, opened=False)))
    assert call in allowed(m) and m.accept(call)   # answering at once with a call
