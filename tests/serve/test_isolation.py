"""Row isolation end to end: a client's bad sampling value is a 400 naming field, value and
limit, and neither it nor a row that fails inside its own step (a grammar that breaks
mid-generation) changes one token of a greedy stream sharing those steps. Sampling values
at the edges (top_k past the vocabulary, seed 2^64-1, XTC) work and do what they document."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest

from tests.serve.test_openai import NO_EOS

VOCAB = 512   # the tiny model's
U64_MAX = (1 << 64) - 1
# Right-recursive with 16 alternatives: every output "a" adds Earley items, and after about
# twenty tokens the parser passes llguidance's 2000-items-per-row limit. Valid to compile,
# failing mid-generation: a real per-row failure inside the sample stage.
BREAKS = 'start: e\ne: "a" | ' + " | ".join('"a"' + " e" * k for k in range(1, 17))
STREAM = {"prompt": "the bystander", "max_tokens": 64, "temperature": 0, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory("cache=off")   # every run computes its tokens: no cache hit hides a step


async def stream_ids(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[str], int]:
    """A streamed completion's token pieces (logprobs' tokens) and the batch size it saw."""
    pieces: list[str] = []
    batch = 0
    async with http.stream("POST", "/v1/completions",
                           json={**body, "stream": True, "logprobs": 0,
                                 "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["logprobs"]:
                    pieces.extend(choice["logprobs"]["tokens"])
            if event.get("usage"):
                batch = event["usage"]["pipeserve"]["batch_size"]
    return pieces, batch


async def beside(base_url: str, others: list[dict[str, Any]]) -> tuple[list[str], int,
                                                                    list[httpx.Response]]:
    """The bystander stream with `others` sent again and again while it runs."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        done = asyncio.Event()

        async def pester() -> list[httpx.Response]:
            out: list[httpx.Response] = []
            while not done.is_set() or not out:
                out += await asyncio.gather(*(http.post("/v1/completions", json=b)
                                              for b in others))
            return out

        async def watched() -> tuple[list[str], int]:
            try:
                return await stream_ids(http, STREAM)
            finally:
                done.set()

        (pieces, batch), answers = await asyncio.gather(watched(), pester())
        return pieces, batch, answers


def sharing(base_url: str, others: list[dict[str, Any]], reference: list[str],
            tries: int = 4) -> list[httpx.Response]:
    """`beside` until the requests shared at least one step with the stream (on a loaded
    machine a round can miss: the others' preparation outlasts the whole stream). Every
    round's stream must equal `reference`; the answers of all rounds come back."""
    answers: list[httpx.Response] = []
    for _ in range(tries):
        pieces, batch, got = asyncio.run(beside(base_url, others))
        assert pieces == reference
        answers += got
        if batch >= 2:
            return answers
    raise AssertionError(f"in {tries} rounds the requests never shared a step with the stream")


def alone(base_url: str) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            return (await stream_ids(http, STREAM))[0]
    return asyncio.run(run())


BAD = [  # (field, value, what the message must name)
    ("seed", -1, "[0, 18446744073709551615]"),
    ("seed", 1 << 64, "18446744073709551615"),
    ("top_k", -2, "-1 or 0 (off)"),
    ("repetition_penalty", 0, "(0.0, 10.0]"),
    ("logit_bias", {str(VOCAB): 5}, f"[0, {VOCAB})"),
    ("top_logprobs", 21, "20"),
]


def test_bad_sampling_values_are_400s_and_the_stream_beside_them_is_exact(server: Any) -> None:
    reference = alone(server.base_url)
    assert len(reference) == 64
    # completions spell top_logprobs `logprobs: N` (at most 5)
    others = [{"prompt": "x", "max_tokens": 8, "temperature": 1.0,
               **({"logprobs": 6} if field == "top_logprobs" else {field: value})}
              for field, value, _ in BAD]
    pieces, batch, answers = asyncio.run(beside(server.base_url, others))
    assert pieces == reference
    for r in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"], err
    seen = {r.json()["error"]["param"] for r in answers}
    assert {"seed", "top_k", "repetition_penalty", "logit_bias", "logprobs"} <= seen
    by_field = {}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for field, value, limit in BAD:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    field: value}
            if field == "top_logprobs":
                body["logprobs"] = True
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            by_field[field] = r.json()["error"]
            assert by_field[field]["param"] == field
            assert limit in by_field[field]["message"], by_field[field]
            assert str(value if not isinstance(value, dict) else VOCAB) in \
                by_field[field]["message"].replace(".0;", ";")


def test_edge_values_run_beside_the_stream_and_it_stays_exact(server: Any) -> None:
    """top_k at and past the vocabulary (no top-k, as vLLM and llama.cpp), -1 (vLLM's off),
    seed 2^64-1, XTC on, top_p 0 and a temperature so small it is greedy: all sample beside
    the greedy stream, which keeps every token."""
    reference = alone(server.base_url)
    edge = [{"top_k": VOCAB}, {"top_k": 10 ** 9}, {"top_k": -1}, {"seed": U64_MAX},
            {"xtc_probability": 0.5, "xtc_threshold": 0.05}, {"top_p": 0.0},
            {"temperature": 1e-30}, {"min_p": 1.0, "top_k": 3, "top_p": 0.5}]
    others = [{"prompt": "x", "max_tokens": 8, "temperature": 1.0, "logit_bias": NO_EOS, **e}
              for e in edge]
    answers = sharing(server.base_url, others, reference)
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8


def test_seed_is_unsigned_64_bit_and_reproducible_at_the_top(server: Any) -> None:
    def text(seed: int) -> str:
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "prompt": "seeds", "max_tokens": 16, "temperature": 1.0, "seed": seed,
            "logit_bias": NO_EOS})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    top = text(U64_MAX)
    assert text(U64_MAX) == top
    assert {text(U64_MAX - 1), text(0), text(1 << 63)} != {top}


def test_top_k_past_the_vocabulary_is_no_top_k(server: Any) -> None:
    def text(**kw: Any) -> str:
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "prompt": "k", "max_tokens": 24, "temperature": 1.0, "seed": 3,
            "logit_bias": NO_EOS, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    plain = text()
    assert text(top_k=VOCAB) == text(top_k=10 ** 6) == text(top_k=-1) == text(top_k=0) == plain
    assert text(top_k=1) == text(temperature=0)


def test_xtc_excludes_the_top_choices_as_documented(server: Any) -> None:
    """xtc_probability 1: at every step where two or more tokens are above xtc_threshold, all
    of them but the least likely are excluded (the stop tokens never are, and NO_EOS keeps
    those out). Checked against the model's own distribution (logprobs report it before any
    truncation); at temperature 0.05 the draw is the most likely token that is left."""
    threshold = 0.05
    body = {"messages": [{"role": "user", "content": "exclude the top choices"}],
            "max_tokens": 24, "temperature": 0.05, "seed": 11, "logit_bias": NO_EOS,
            "logprobs": True, "top_logprobs": 5}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        def run(**kw: Any) -> dict[str, Any]:
            r = http.post("/v1/chat/completions", json={**body, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        plain = run()
        xtc = run(xtc_probability=1.0, xtc_threshold=threshold)
        off = run(xtc_probability=0.0, xtc_threshold=threshold)
    assert off["message"]["content"] == plain["message"]["content"]
    assert xtc["message"]["content"] != plain["message"]["content"]
    cut_steps = 0
    for entry in xtc["logprobs"]["content"]:   # tokens by their bytes: texts can collide
        above = {tuple(t["bytes"]): math.exp(t["logprob"]) for t in entry["top_logprobs"]
                 if math.exp(t["logprob"]) > threshold}
        if len(above) < 2:
            continue
        cut_steps += 1
        least = min(above, key=above.__getitem__)
        assert tuple(entry["bytes"]) not in set(above) - {least}, (entry, above)
    assert cut_steps >= 5, "too few steps had two tokens above the threshold to show XTC"


def test_a_grammar_that_breaks_fails_only_its_own_row(server: Any) -> None:
    """The grammar passes llguidance's parser limits after ~20 tokens: that request fails
    (400 naming guided_grammar, non-streaming; an error event, streaming) while the greedy
    stream sharing its steps keeps every token."""
    reference = alone(server.base_url)
    breaking = {"prompt": [120], "max_tokens": 60, "temperature": 0, "guided_grammar": BREAKS,
                "logit_bias": NO_EOS}
    answers = sharing(server.base_url, [breaking], reference)
    for r in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "guided_grammar" and err["code"] == "constraint_failed", err
        assert "could not be followed after" in err["message"] and "max is 2000" in err["message"]
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={**breaking, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["param"] == "guided_grammar", events[-1]
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert text and set(text) == {"a"}   # what the grammar allowed, until it broke
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_with_drafts_a_breaking_grammar_fails_only_its_row(server_factory: Any) -> None:
    """draft=ngram: rows draft and verify (the breaking row drafts its own repeated "a"s until
    its grammar breaks); the failing row leaves the shared batch and the greedy stream in
    the same steps still matches its run alone token for token."""
    spec = server_factory("draft=ngram", "cache=off")
    reference = alone(spec.base_url)
    # 67 is "a" in the tiny vocabulary
    breaking = {"prompt": [67] * 12, "max_tokens": 60, "temperature": 0,
                "guided_grammar": BREAKS, "logit_bias": NO_EOS}
    answers = sharing(spec.base_url, [breaking], reference)
    for r in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "constraint_failed"
    metrics = httpx.get(f"{spec.base_url}/metrics").text
    verifies = [float(ln.split()[-1]) for ln in metrics.splitlines()
                if ln.startswith("pipeserve_speculation_verifies_total")]
    assert verifies and verifies[0] > 0, "no verify forward ran"
