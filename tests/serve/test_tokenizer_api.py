"""End to end: the tokenizer endpoints (POST /tokenize, /detokenize, /v1/chat/template) on a
real `serve.py`, checked against the model's own tokenizer and against what the generation
endpoints report as prompt_tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pipeserve.model.tiny.text import ensure_model

MODEL = "tiny"
TIMEOUT = 60.0
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory("server.api_key=k1")


@pytest.fixture(scope="module")
def tokenizer(model_cache: Path) -> Any:
    from mlx_lm.utils import load_tokenizer
    return load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))


def post(srv: Any, path: str, body: dict[str, Any], key: str | None = "k1") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.base_url + path, json={"model": MODEL, **body}, headers=headers,
                      timeout=TIMEOUT)


def test_tokenize_a_prompt_equals_the_tokenizer_and_completions_prompt_tokens(
        srv: Any, tokenizer: Any) -> None:
    text = "The morning train left the station at seven."
    r = post(srv, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096
    assert "".join(body["token_strs"]) == text   # byte-level BPE: the pieces spell the text
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k1", max_retries=0)
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]


def test_tokenize_messages_equals_the_chat_template_and_chat_prompt_tokens(
        srv: Any, tokenizer: Any) -> None:
    r = post(srv, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=False)
    assert r.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k1", max_retries=0)
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert done.usage.prompt_tokens == r.json()["count"]
    # without the generation prompt: the assistant header is not there
    bare = post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False),
        add_special_tokens=False)
    assert bare["count"] < r.json()["count"]


def test_detokenize_round_trips_and_chat_template_renders(srv: Any, tokenizer: Any) -> None:
    ids = post(srv, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    r = post(srv, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=False)
    assert r.json() == {"prompt": rendered}
    t = post(srv, "/v1/chat/template", {"messages": MESSAGES})
    assert t.status_code == 200, t.text
    assert t.json()["prompt"] == rendered
    assert t.json()["num_tokens"] == len(ids)
    assert t.json()["model"] == MODEL
    cont = post(srv, "/v1/chat/template", {
        "messages": [*MESSAGES, {"role": "assistant", "content": "It is half"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert cont["prompt"].endswith("It is half")   # the turn is left open to continue


def test_detokenize_equals_the_tokenizer_on_every_id(srv: Any, tokenizer: Any) -> None:
    import random

    rng = random.Random(7)
    vocab = len(tokenizer)
    for ids in (list(range(vocab)), [rng.randrange(vocab) for _ in range(3000)],
                [rng.randrange(vocab) for _ in range(7)]):
        r = post(srv, "/detokenize", {"tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == tokenizer.decode(ids)


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "prompt", ["prompt", "messages"]),
    ("/tokenize", {"prompt": 5}, "prompt", ["string"]),
    ("/tokenize", {"messages": []}, "messages", ["messages"]),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens", ["tokens[1]", "[0, 512)"]),
    ("/detokenize", {"tokens": "abc"}, "tokens", ["array"]),
    ("/v1/chat/template", {"prompt": "x"}, "messages", ["messages"]),
    ("/v1/chat/template", {"messages": MESSAGES, "continue_final_message": True,
                           "add_generation_prompt": False}, "continue_final_message",
     ["assistant"]),
])
def test_bad_tokenizer_requests_are_400_naming_the_field(srv: Any, path: str,
                                                         body: dict[str, Any], param: str,
                                                         words: list[str]) -> None:
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"]


def test_tokenizer_endpoints_need_the_api_key(srv: Any) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert post(srv, path, body, key=None).status_code == 401
        assert post(srv, path, body, key="wrong").status_code == 401


def test_an_agents_next_turns_count_and_tokenize_as_the_tokenizer_does(
        srv: Any, tokenizer: Any) -> None:
    """Chats past encode_reuse.MIN_CHARS, turn after turn: the server encodes each one from the
    turn before it (pipeserve/eventloop/encode_reuse.py), and what it counts and tokenizes is
    the tokenizer's own encoding of the whole rendered chat."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "how-it-works.md").read_text()
    messages = [{"role": "system", "content": doc[:2500]},
                {"role": "user", "content": "Which thread owns the MLX state?"}]
    for turn in range(3):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        want = tokenizer.encode(text, add_special_tokens=False)
        r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        t = post(srv, "/tokenize", {"messages": messages})
        assert t.status_code == 200, t.text
        assert t.json()["tokens"] == want
        answer = r.json()["choices"][0]["message"]["content"] or "ok"
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"And step {turn}? "
                      + doc[3000 + 400 * turn:3400 + 400 * turn]}]
