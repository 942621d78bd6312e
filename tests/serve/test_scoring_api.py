"""End to end: /v1/completions as scoring clients drive it — prompt arrays, echo with prompt
logprobs and exact text_offsets, max_tokens 0, suffix — on a real `serve.py`, with the
loglikelihoods checked against mlx-lm's own forward on the same model (float32 weights:
agreement to 1e-4 per token). The lm-evaluation-harness run itself is in test_lm_eval.py."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pipeserve.model.tiny.text import ensure_model

MODEL = "tiny"
TIMEOUT = 60.0
NO_EOS = {"0": -100, "2": -100}
TOL = 1e-4   # float32 model: the server's logprobs and mlx-lm's differ by rounding only


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory()


@pytest.fixture(scope="module")
def reference(model_cache: Path) -> Any:
    """mlx-lm on the same generated model: (tokenizer, logprobs of each token given the ones
    before it)."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(ensure_model("qwen3", "tiny", "float32", model_cache)))

    def logprobs(ids: list[int]) -> list[float]:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [lps[i, ids[i + 1]].item() for i in range(len(ids) - 1)]

    def greedy(ids: list[int], start: int) -> bool:
        """Whether every token from `start` on is the argmax after the ones before it."""
        best = mx.argmax(model(mx.array(ids)[None])[0], axis=-1).tolist()
        return all(best[i - 1] == ids[i] for i in range(start, len(ids)))
    def extend(ids: list[int], k: int) -> list[int]:
        """The k tokens greedy decoding writes after `ids`."""
        out = list(ids)
        for _ in range(k):
            out.append(int(mx.argmax(model(mx.array(out)[None])[0, -1]).item()))
        return out[len(ids):]
    logprobs.greedy, logprobs.extend = greedy, extend   # type: ignore[attr-defined]
    return tokenizer, logprobs


def complete(srv: Any, **body: Any) -> dict[str, Any]:
    r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, **body},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_max_tokens_0_scores_the_prompt_as_mlx_lm(srv: Any, reference: Any) -> None:
    tokenizer, logprobs = reference
    text = "The morning train left the station at seven, café 🙂 and 42."
    body = complete(srv, prompt=text, max_tokens=0, echo=True, logprobs=2)
    (choice,) = body["choices"]
    ids = tokenizer.encode(text)
    lp = choice["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(logprobs(ids), abs=TOL)
    for top, value in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        assert 1 <= len(top) <= 2 and max(top.values()) >= value - TOL
    # exact offsets: token i starts where the decode of the tokens before it ends
    for i, offset in enumerate(lp["text_offset"]):
        before = tokenizer.decode(ids[:i])
        if "\ufffd" not in before:   # inside a multi-byte character a decode is not text yet
            assert offset == len(before), i
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_with_one_generated_token_is_lm_evals_request(srv: Any, reference: Any) -> None:
    """lm-eval's loglikelihood payload: token-array prompts, echo, max_tokens 1, logprobs 1;
    it sums token_logprobs[ctxlen:-1] (the continuation, without the generated token)."""
    tokenizer, logprobs = reference
    pairs = [("Where are my keys?", " On the table."), ("It is half past", " three.")]
    prompts = [tokenizer.encode(c) + tokenizer.encode(x) for c, x in pairs]
    body = complete(srv, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0,
                    seed=1234, logit_bias=NO_EOS)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for (ctx, _), ids, choice in zip(pairs, prompts, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1   # the prompt, then the one token
        ctxlen = len(tokenizer.encode(ctx))
        want = sum(logprobs(ids)[ctxlen - 1:])
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(want, abs=TOL * len(ids))
        generated = lp["tokens"][-1]
        assert choice["text"] == tokenizer.decode(ids) + generated
        assert lp["text_offset"][-1] == len(tokenizer.decode(ids))


def test_prompt_arrays_give_one_choice_per_prompt_and_n(srv: Any) -> None:
    prompts = ["Once upon a time", "The quiet library", [72, 101, 108]]
    one_by_one = [complete(srv, prompt=p, max_tokens=4, temperature=0,
                           logit_bias=NO_EOS)["choices"][0]["text"] for p in prompts]
    body = complete(srv, prompt=prompts, max_tokens=4, temperature=0, n=2,
                    logit_bias=NO_EOS)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, c in enumerate(body["choices"]):
        assert c["text"] == one_by_one[i // 2]   # greedy: both choices of a prompt agree
        assert c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6 * 4
    # the SDK reads the same body
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=2,
                                  temperature=0, logprobs=0)
    assert len(r.choices) == 2 and all(len(c.logprobs.tokens) == 2 for c in r.choices)


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["echo"]),
    ({"prompt": "x", "suffix": "y"}, "suffix", ["fill-in-the-middle", "<fim_prefix>"]),
    ({"prompt": ["a", 5]}, "prompt", ["prompt[1]"]),
    ({"prompt": []}, "prompt", ["non-empty"]),
    ({"prompt": ["a", "b"], "stream": True}, "prompt", ["2 prompts", "stream"]),
    ({"prompt": [[1, 2], [3, 99999]], "max_tokens": 2}, "prompt", ["99999"]),
])
def test_bad_scoring_requests_are_400_naming_the_field(srv: Any, body: dict[str, Any],
                                                       param: str, words: list[str]) -> None:
    r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, **body},
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"]


def test_loglikelihood_task_through_http_equals_mlx_lm(srv: Any, reference: Any) -> None:
    """What lm-eval's local-completions does for a loglikelihood (multiple-choice) task, call
    for call: /tokenize each context and continuation, one batched completions request,
    sum(token_logprobs[ctxlen:-1]) and the greedy check over top_logprobs."""
    tokenizer, logprobs = reference
    docs = [("Question: Where are my keys?\nAnswer:", [" On the table.", " In the river."]),
            ("Question: What time is it?\nAnswer:", [" It is half past three.", " Blue."])]
    requests = []
    for context, options in docs:
        for option in options:
            def tok(text: str) -> list[int]:
                r = httpx.post(srv.base_url + "/tokenize",
                               json={"prompt": text, "add_special_tokens": False},
                               timeout=TIMEOUT)
                return r.json()["tokens"]
            requests.append((tok(context), tok(option)))
        requests.append((requests[-1][0], logprobs.extend(requests[-1][0], 3)))   # greedy
    payload = {"model": MODEL, "prompt": [c + x for c, x in requests], "temperature": 0,
               "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = complete(srv, **{k: v for k, v in payload.items() if k != "model"})
    flags: list[bool] = []
    for (ctx, cont), choice in zip(requests, sorted(out["choices"], key=lambda c: c["index"])):
        lp = choice["logprobs"]
        got = sum(lp["token_logprobs"][len(ctx):-1])
        want = sum(logprobs(ctx + cont)[len(ctx) - 1:])
        assert got == pytest.approx(want, abs=TOL * len(cont))
        greedy = all(v == max(top.values()) for v, top in
                     zip(lp["token_logprobs"][len(ctx):-1], lp["top_logprobs"][len(ctx):-1]))
        assert greedy == logprobs.greedy(ctx + cont, len(ctx))
        flags.append(greedy)
        assert math.isfinite(got)
    assert flags[-1] and len(flags) == len(requests)   # the greedy continuation is seen as one
