"""pipeserve.grammar.constraint and the structured-output request fields, without a model: constraints
compiled against the tiny model's real tokenizer, random walks through the token masks always
end in valid output, bad constraints are 400s naming their field, and the LRU keeps its cap."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from pipeserve.http.api import structured
from pipeserve.errors import InvalidRequest
from pipeserve.grammar.constraint import Constraint, ConstraintKind, GrammarCompiler, Matcher, fill_bitmask
from pipeserve.model.tiny.text import VOCAB_SIZE, ensure_model

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(model_cache: Path) -> Any:
    return load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids)


def allowed(m: Matcher) -> np.ndarray:
    bits = np.unpackbits(m.allowed_mask().view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0]


def walk(m: Matcher, eos: set[int], rng: np.random.Generator,
         limit: int = 300) -> tuple[list[int], bool]:
    """Pick allowed tokens at random until a stop token is picked; (ids, stopped)."""
    ids: list[int] = []
    for _ in range(limit):
        choices = allowed(m)
        assert len(choices), "a live matcher always allows something"
        token = int(rng.choice(choices))
        if token in eos:
            return ids, True
        assert m.accept(token)
        ids.append(token)
    return ids, False


def test_random_walks_through_a_schema_always_validate(compiler, tokenizer) -> None:
    rng = np.random.default_rng(0)
    eos = set(tokenizer.eos_token_ids)
    c = Constraint.json_schema(SCHEMA, "response_format")
    for _ in range(30):
        ids, stopped = walk(compiler.matcher(c), eos, rng)
        assert stopped
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


@pytest.mark.parametrize("constraint, check", [
    (Constraint.regex(r"[0-9]{3}-[a-z]{2}", "guided_regex"),
     lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2}", s)),
    (Constraint.choice(["yes", "no", "not sure"], "guided_choice"),
     lambda s: s in ("yes", "no", "not sure")),
    (Constraint.grammar('root ::= "(" [a-z]{1,4} ("," [a-z]{1,4}){0,2} ")"', "guided_grammar"),
     lambda s: re.fullmatch(r"\([a-z]{1,4}(,[a-z]{1,4}){0,2}\)", s)),
    (Constraint.grammar('start: "[" N (";" N)~0..3 "]"\nN: /[1-9][0-9]?/', "guided_grammar"),
     lambda s: re.fullmatch(r"\[[1-9][0-9]?(;[1-9][0-9]?){0,3}\]", s)),
    (Constraint.json_object("response_format"), lambda s: isinstance(json.loads(s), dict)),
])
def test_random_walks_match_regex_choice_grammar(compiler, tokenizer, constraint, check) -> None:
    rng = np.random.default_rng(1)
    eos = set(tokenizer.eos_token_ids)
    done = 0
    for _ in range(20):
        ids, stopped = walk(compiler.matcher(constraint), eos, rng)
        if stopped:   # a JSON object may still be open after `limit` random tokens
            assert check(tokenizer.decode(ids)), tokenizer.decode(ids)
            done += 1
    assert done >= 10


def test_a_complete_grammar_allows_only_the_stop_tokens(compiler, tokenizer) -> None:
    m = compiler.matcher(Constraint.choice(["yes", "no"], "guided_choice"))
    assert not m.is_terminated()
    assert m.advance(tokenizer.encode("yes", add_special_tokens=False))
    assert m.is_terminated() and m.is_accepting()
    assert set(allowed(m)) == set(tokenizer.eos_token_ids)
    fresh = compiler.matcher(Constraint.choice(["yes", "no"], "guided_choice"))
    assert not fresh.is_terminated()   # matchers from one cached grammar are independent
    assert not fresh.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert fresh.error


def test_advance_accepts_only_new_tokens(compiler, tokenizer) -> None:
    m = compiler.matcher(Constraint.regex("[a-z]+", "guided_regex"))
    ids = tokenizer.encode("abcdef", add_special_tokens=False)
    assert m.advance(ids[:1]) and m.num_accepted == 1
    assert m.advance(ids) and m.num_accepted == len(ids)
    assert m.advance(ids) and m.num_accepted == len(ids)


def test_mask_covers_the_model_vocab_with_padding(tokenizer) -> None:
    wide = GrammarCompiler(tokenizer, VOCAB_SIZE + 100, tokenizer.eos_token_ids)
    m = wide.matcher(Constraint.json_object("response_format"))
    assert m.num_words == (VOCAB_SIZE + 100 + 31) // 32
    assert allowed(m).max() < VOCAB_SIZE    # rows past the tokenizer are never allowed
    out = np.full((3, m.num_words + 2), -1, dtype=np.int32)
    fill_bitmask([(1, m)], out)
    assert (out[0] == -1).all() and (out[2] == -1).all()   # free rows untouched
    assert (out[1, m.num_words:] == 0).all()
    assert (out[1, :m.num_words] == m.allowed_mask()).all()
    narrow = np.full((1, 4), -1, dtype=np.int32)
    fill_bitmask([(0, m)], narrow)
    assert (narrow[0] == m.allowed_mask()[:4]).all()


def test_compiled_grammars_are_an_lru(tokenizer) -> None:
    small = GrammarCompiler(tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids, cache_size=2)
    a, b, c = (Constraint.regex(p, "guided_regex") for p in ("a+", "b+", "c+"))
    small.matcher(a)
    small.matcher(b)
    small.matcher(a)   # a is now the most recent
    small.matcher(c)   # evicts b
    assert len(small) == 2
    assert set(small._cache) == {a.key, c.key}


@pytest.mark.parametrize("constraint, fragment", [
    (Constraint.json_schema({"type": "strin"}, "response_format"), "strin"),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"not": {}}}},
                            "response_format"), "not"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}, "text.format"), "uniqueItems"),
    (Constraint.json_schema({"$ref": "#/missing"}, "guided_json"), "missing"),
    (Constraint.regex("(?<=a)b", "guided_regex"), "look-around"),
    (Constraint.regex("a{2,1}", "guided_regex"), "repetition"),
    (Constraint.grammar("start: undefined_rule", "guided_grammar"), "undefined_rule"),
    (Constraint.grammar("root ::= ( \"a\"", "guided_grammar"), "GBNF"),
])
def test_bad_constraints_are_400s_naming_the_field(compiler, constraint, fragment) -> None:
    with pytest.raises(InvalidRequest) as info:
        compiler.matcher(constraint)
    assert info.value.param == constraint.param
    assert info.value.message.startswith(constraint.param)
    assert fragment in info.value.message


# -- request fields → Constraint ------------------------------------------------------------
def test_openai_fields_map_to_constraints() -> None:
    assert structured.from_body({}) is None
    assert structured.from_body({"response_format": {"type": "text"}}) is None
    c = structured.from_body({"response_format": {"type": "json_object"}})
    assert c is not None and c.kind is ConstraintKind.JSON_OBJECT and c.param == "response_format"
    c = structured.from_body({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}})
    assert c is not None and c.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(c.source) == SCHEMA
    assert list(json.loads(c.source)["properties"]) == list(SCHEMA["properties"])   # key order kept
    c = structured.from_body({"guided_choice": ["a", "b"]})
    assert c is not None and c.kind is ConstraintKind.CHOICE and c.param == "guided_choice"
    c = structured.from_body({"guided_json": json.dumps(SCHEMA)})
    assert c is not None and c.kind is ConstraintKind.JSON_SCHEMA and c.param == "guided_json"
    c = structured.from_body({"guided_grammar": "start: \"x\""})
    assert c is not None and c.kind is ConstraintKind.GRAMMAR
    assert structured.from_body({"response_format": {"type": "json_object"}},
                                format_field=None) is None   # Anthropic: no response_format


def test_responses_text_format_maps_to_a_constraint() -> None:
    fmt = {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}
    c, echo = structured.from_text_format({"text": {"format": fmt}})
    assert c is not None and c.param == "text.format" and echo == fmt
    c, echo = structured.from_text_format({})
    assert c is None and echo == {"type": "text"}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": 5}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
])
def test_malformed_fields_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        structured.from_body(body)
    assert info.value.param == param
