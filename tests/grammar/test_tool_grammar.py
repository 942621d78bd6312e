"""Grammar-enforced tool calls on a real engine: the generated tiny model, whose free output
never forms a call, returns a well-formed, schema-valid call in every family's own markup when
the call is required or named; strict schemas refuse extra keys; parallel_tool_calls false
yields one call; and unconstrained rows decoded in the same batch keep their tokens."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeserve.http.api.generation import Delta, OutputChain
from pipeserve.http.api.harmony import HarmonySplitter
from pipeserve.http.api.tools import ToolCallParser
from pipeserve.grammar.constraint import GrammarCompiler
from pipeserve.markup.tool_formats import FORMATS
from pipeserve.grammar.tool import marker_lit, tool_constraint
from pipeserve.grammar.turn import added_tokens
from tests.conftest import EngineHarness, make_config

WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
ENFORCED = sorted(name for name, f in FORMATS.items() if f.grammar is not None)
PROMPT = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def harness(model_cache: Path) -> Iterator[EngineHarness]:
    h = EngineHarness(make_config(f"model.cache_dir={model_cache}"))
    yield h
    h.close()


def constrained(h: EngineHarness, compiler: GrammarCompiler, fmt: str, name: str | None,
                parallel: bool, max_tokens: int = 256) -> Any:
    tok = h.loaded.tokenizer
    req = h.request(tok.encode(PROMPT), max_tokens=max_tokens)
    req.constraint = tool_constraint(FORMATS[fmt], TOOLS, name, parallel,
                                     marker_lit(added_tokens(tok)))
    req.grammar = compiler.matcher(req.constraint)
    return req


def calls_of(h: EngineHarness, fmt: str, ids: list[int]) -> tuple[Delta, str]:
    text = h.loaded.tokenizer.decode(ids, skip_special_tokens=False)
    chain = OutputChain(HarmonySplitter() if fmt == "harmony" else None,
                        ToolCallParser(FORMATS[fmt], TOOLS, "test"))
    return chain.feed(text).extend(chain.finish()), text


def valid(name: str, args: dict[str, Any]) -> bool:
    if name == "now":
        return args == {}
    return (set(args) <= {"city", "days"} and isinstance(args.get("city"), str)
            and len(args["city"]) <= 8
            and ("days" not in args or (type(args["days"]) is int and 1 <= args["days"] <= 7)))


def test_every_family_returns_a_valid_call_beside_unconstrained_rows(harness: EngineHarness) -> None:
    h, tok = harness, harness.loaded.tokenizer
    compiler = GrammarCompiler(tok, 512, tok.eos_token_ids)
    plain_prompts = [tok.encode("The morning train left"), tok.encode("Rain fell on the roof")]
    solo = [h.generate(p, max_tokens=24) for p in plain_prompts]
    reqs = [constrained(h, compiler, fmt, name, parallel=False)
            for fmt in ENFORCED for name in (None, "get_weather")]
    reqs += [h.request(p, max_tokens=24) for p in plain_prompts]
    results = asyncio.run(h.generate_many(reqs))
    for i, fmt in enumerate(f for f in ENFORCED for _ in range(2)):
        named = i % 2 == 1
        delta, text = calls_of(h, fmt, results[i]["ids"])
        got = [(c.name, c.arguments) for c in delta.tool_calls]
        assert len(got) == 1, (fmt, text, results[i]["finish"])
        assert valid(*got[0]), (fmt, text)
        assert delta.content.strip() == "" and delta.reasoning == "", (fmt, text)
        if named:
            assert got[0][0] == "get_weather", (fmt, text)
    for solo_run, batched in zip(solo, results[-2:]):
        assert batched["ids"] == solo_run["ids"]   # unconstrained rows keep their tokens
        assert calls_of(h, "hermes", batched["ids"])[0].tool_calls == []   # free text: no call


def test_parallel_calls_and_strict_extra_keys(harness: EngineHarness) -> None:
    h, tok = harness, harness.loaded.tokenizer
    compiler = GrammarCompiler(tok, 512, tok.eos_token_ids)
    # several calls may come when parallel calls are on; each one is valid
    req = constrained(h, compiler, "hermes", None, parallel=True, max_tokens=120)
    [out] = asyncio.run(h.generate_many([req]))
    delta, text = calls_of(h, "hermes", out["ids"])
    assert delta.tool_calls and all(valid(c.name, c.arguments) for c in delta.tool_calls), text
    # strict: a key the schema does not declare cannot be generated
    ll = compiler.matcher(tool_constraint(FORMATS["hermes"], TOOLS, "get_weather", False,
                                          marker_lit(added_tokens(tok)))).ll
    ids = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "x": 1}}')
    assert not all(ll.consume_token(t) for t in ids)
